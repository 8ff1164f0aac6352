"""Build and load the native weight-streaming engine (native/stream_engine.cpp) with torch's JIT extension builder.

One build serves the CPU and CUDA devices: the CUDA path calls the driver API resolved at run time from libcuda.so.1,
so building needs only a C++ compiler, torch's headers and ninja (no CUDA toolkit, no nvcc). CI on a CPU machine
therefore compiles exactly the code a GPU machine runs.

The shared object is cached under `cache_root()` in a directory named by torch and Python versions and a hash of the
source and flags, so an edited source or a new torch rebuilds and an unchanged one loads in well under a second.
torch serialises concurrent builds of one directory with a file lock. Prebuild (e.g. from the Makefile):

    python native/build.py            # builds (or finds) the extension, prints where and how long it took

Nothing here runs at import; `load()` is called the first time weights are streamed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "stream_engine.cpp"
CFLAGS = ["-O2"]
LDFLAGS = ["-ldl"]

_loaded: dict[str, object] = {}


class NativeBuildFailed(RuntimeError):
    """The extension could not be built or loaded; the message says what is missing."""


def cache_root() -> Path:
    """$KIMISERVE_NATIVE_CACHE, else $XDG_CACHE_HOME/kimiserve/native, else ~/.cache/kimiserve/native."""
    if os.environ.get("KIMISERVE_NATIVE_CACHE"):
        return Path(os.environ["KIMISERVE_NATIVE_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kimiserve" / "native"


def _tag() -> str:
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:12]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"torch{torch.__version__.replace('+', '_')}-{py}-{digest}"


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: add the venv's bin and the `ninja` wheel's, if not already there."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # the PyPI wheel (test extra)

        dirs.append(str(Path(ninja.BIN_DIR)))
    except ImportError:
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([d for d in dirs if d not in path] + path)
    if shutil.which("ninja") is None:
        raise NativeBuildFailed("building the native streaming engine needs `ninja` (pip install ninja, part of the "
                                "project's test extra); none on PATH")


def load(verbose: bool = False):
    """The built module (compiling it on first use in this cache directory)."""
    if "module" in _loaded:
        return _loaded["module"]
    from torch.utils import cpp_extension

    _ninja_on_path()
    tag = _tag()
    build_dir = cache_root() / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=f"kimiserve_stream_{tag.rsplit('-', 1)[1]}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            with_cuda=False,  # the CUDA driver API is loaded at run time: no toolkit needed
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - re-raised with what was being built and where
        raise NativeBuildFailed(f"building {SOURCE.name} in {build_dir} failed: {e}") from e
    module.BUILD_SECONDS = time.perf_counter() - start  # type: ignore[attr-defined]
    module.BUILD_DIR = str(build_dir)  # type: ignore[attr-defined]
    _loaded["module"] = module
    return module


def main() -> int:
    module = load(verbose="-v" in sys.argv)
    print(f"native streaming engine ready in {module.BUILD_DIR} ({module.BUILD_SECONDS:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
