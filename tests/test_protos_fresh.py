"""The committed gRPC stubs in kimiserve/v1 must be exactly what `make protos` generates from protos/."""

from pathlib import Path

from kimiserve import protogen
from tests.fresh_process import run_python


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    committed = protogen.stub_files(protogen.REPO_ROOT)
    assert fresh, "protoc generated nothing"
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    assert not missing, f"stubs not committed: {[str(p) for p in missing]}; run `make protos` and commit them"
    assert not extra, f"stale stubs without a .proto: {[str(p) for p in extra]}; delete them and run `make protos`"
    for rel in fresh:
        if (tmp_path / rel).read_bytes() != (protogen.REPO_ROOT / rel).read_bytes():
            raise AssertionError(f"{rel} is stale: it differs from what protos/ generates; "
                                 "run `make protos` and commit")


def test_generation_is_deterministic(tmp_path: Path) -> None:
    """Two processes with other hash seeds generate the same bytes."""
    first, second = tmp_path / "a", tmp_path / "b"
    protogen.generate(first)
    run_python(f"from pathlib import Path; from kimiserve import protogen; protogen.generate(Path({str(second)!r}))")
    for rel in protogen.stub_files(first):
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), f"{rel} differs between two runs"
