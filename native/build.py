"""Build and load the native weight-streaming engine (native/stream_engine.cpp) with torch's JIT extension builder.

One source, two builds with the same API:
- `cuda`: when torch sees a CUDA device and nvcc (CUDA_HOME) exists: cudaMemcpyAsync on a dedicated stream, events;
- `cpu`: everywhere else (CI): host slots, a worker thread as the copy stream.

The shared object is cached under `cache_root()` in a directory named by variant, torch and Python versions and a
hash of the source and flags, so an edited source or a new torch rebuilds and an unchanged one loads in well under a
second. torch serialises concurrent builds of one directory with a file lock. Prebuild (e.g. from the Makefile):

    python native/build.py            # builds the variant this machine would load, prints where

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
CUDA_DEFINE = "-DKIMISERVE_WITH_CUDA"

_loaded: dict[str, object] = {}


class NativeBuildFailed(RuntimeError):
    """The extension could not be built or loaded; the message says what is missing."""


def cache_root() -> Path:
    """$KIMISERVE_NATIVE_CACHE, else $XDG_CACHE_HOME/kimiserve/native, else ~/.cache/kimiserve/native."""
    if os.environ.get("KIMISERVE_NATIVE_CACHE"):
        return Path(os.environ["KIMISERVE_NATIVE_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kimiserve" / "native"


def cuda_toolkit() -> str | None:
    """CUDA_HOME when nvcc exists there, else None."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None and shutil.which("nvcc"):
        home = str(Path(shutil.which("nvcc")).resolve().parent.parent)
    if home and (Path(home) / "bin" / "nvcc").exists():
        return home
    return None


def default_variant() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and torch.version.cuda and cuda_toolkit() else "cpu"


def _tag(variant: str) -> str:
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS + [variant]).encode()).hexdigest()[:12]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"{variant}-torch{torch.__version__.replace('+', '_')}-{py}-{digest}"


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


def load(variant: str | None = None, verbose: bool = False):
    """The built module (compiling it on first use). variant None: `default_variant()`."""
    variant = variant or default_variant()
    if variant not in ("cpu", "cuda"):
        raise NativeBuildFailed(f"unknown native variant {variant!r} (cpu, cuda)")
    if variant in _loaded:
        return _loaded[variant]
    if variant == "cuda" and cuda_toolkit() is None:
        raise NativeBuildFailed("the CUDA build of the native streaming engine needs the CUDA toolkit (nvcc); "
                                "none found via CUDA_HOME or PATH")
    from torch.utils import cpp_extension

    _ninja_on_path()
    tag = _tag(variant)
    build_dir = cache_root() / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = CFLAGS + ([CUDA_DEFINE] if variant == "cuda" else [])
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=f"kimiserve_stream_{tag.split('-')[0]}_{tag.rsplit('-', 1)[1]}",
            sources=[str(SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-lcudart"] if variant == "cuda" else [],
            with_cuda=variant == "cuda",
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - re-raised with what was being built and where
        raise NativeBuildFailed(f"building {SOURCE.name} ({variant}) in {build_dir} failed: {e}") from e
    module.BUILD_SECONDS = time.perf_counter() - start  # type: ignore[attr-defined]
    module.BUILD_DIR = str(build_dir)  # type: ignore[attr-defined]
    _loaded[variant] = module
    return module


def main() -> int:
    variant = sys.argv[1] if len(sys.argv) > 1 else None
    module = load(variant, verbose="-v" in sys.argv)
    print(f"native streaming engine ({'cuda' if module.WITH_CUDA else 'cpu'}) ready in {module.BUILD_DIR} "
          f"({module.BUILD_SECONDS:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
