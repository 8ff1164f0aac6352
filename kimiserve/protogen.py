"""Generate the Python gRPC stubs from protos/ (`python -m kimiserve.protogen`, or `make protos`).

Stubs land in kimiserve/v1/ so the Python package mirrors the proto package `kimiserve.v1`. Generation is
reproducible: the inputs are passed in sorted order and protoc's output depends only on them and on the
grpcio-tools version, so tests/test_protos_fresh.py can regenerate and compare byte for byte.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("kimiserve") / "v1"
STUB_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

log = logging.getLogger(__name__)


class ProtoGenError(RuntimeError):
    """protoc failed; the message carries its exit code and the files involved."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files, relative to proto_root, in a fixed (sorted) order."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PROTO_PACKAGE_DIR).glob("*.proto"))


def stub_files(out_root: Path) -> list[Path]:
    """Generated stub files under out_root/kimiserve/v1, relative to out_root, sorted."""
    pkg = out_root / PROTO_PACKAGE_DIR
    return sorted(p.relative_to(out_root) for p in pkg.iterdir() if p.name.endswith(STUB_SUFFIXES))


def generate(out_root: Path = REPO_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on every proto; returns the stub paths written, relative to out_root."""
    # Imported here so that `kimiserve.protogen` can be imported (e.g. for its paths) without grpcio-tools.
    from grpc_tools import protoc
    import grpc_tools

    protos = proto_files(proto_root)
    if not protos:
        raise ProtoGenError(f"no .proto files under {proto_root / PROTO_PACKAGE_DIR}")
    (out_root / PROTO_PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto shipped with grpcio-tools
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *(str(p) for p in protos),
    ]
    # protoc resolves inputs relative to the -I roots, so generated imports read `from kimiserve.v1 import ...`.
    rc = protoc.main(args)
    if rc != 0:
        raise ProtoGenError(f"protoc exited with {rc} for {[str(p) for p in protos]} (proto root {proto_root})")
    return stub_files(out_root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root the kimiserve/v1 stubs are written under")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    written = generate(args.out)
    log.info("wrote %d stub files under %s", len(written), args.out / PROTO_PACKAGE_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
