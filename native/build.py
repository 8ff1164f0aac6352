"""Build and load the native weight-streaming engine (stream_engine.cpp beside this file) with torch's JIT extension
builder.

One build serves the CPU and CUDA devices: the CUDA path calls the driver API resolved at run time from libcuda.so.1,
so building needs only a C++ compiler and torch's headers (no CUDA toolkit, no nvcc). CI on a CPU machine therefore
compiles exactly the code a GPU machine runs. With ninja (test extra) torch's JIT builder compiles it; without ninja,
one direct compiler call with the same flags does.

The shared object is cached under `cache_root()` in a directory named by torch and Python versions and a hash of the
source and flags, so an edited source or a new torch rebuilds and an unchanged one loads in well under a second. A
direct build found there is loaded without writing anything, so a cache prebuilt into an image works read-only.
Concurrent builds of one directory are serialised by a file lock. Prebuild (e.g. in the Dockerfile):

    python -m native.build            # builds (or finds) it, prints where and how long
    python -m native.build --direct   # the same without ninja

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


def _ninja_on_path() -> bool:
    """torch's builder runs `ninja` from PATH: add the venv's bin and the `ninja` wheel's; True if one is there."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # the PyPI wheel (test extra)

        dirs.append(str(Path(ninja.BIN_DIR)))
    except ImportError:
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([d for d in dirs if d not in path] + path)
    return shutil.which("ninja") is not None


def load(verbose: bool = False, use_ninja: bool | None = None):
    """The built module (compiling it on first use in this cache directory).

    With ninja (the test extra installs it) torch's JIT builder compiles it; without, one direct compiler call with
    the same flags does (machines that cannot install packages, e.g. an offline GPU host). Either way it is logged.
    `use_ninja` None: a direct build already in the cache, else ninja where there is one, else a direct build."""
    if "module" in _loaded:
        return _loaded["module"]
    tag = _tag()
    name = f"kimiserve_stream_{tag.rsplit('-', 1)[1]}"
    if use_ninja is None:  # a direct build already there (the image's prebuild) is used as it is, ninja or not
        prebuilt = (cache_root() / (tag + "-direct") / f"{name}.so").exists()
        use_ninja = not prebuilt and _ninja_on_path()
    elif use_ninja:
        _ninja_on_path()  # torch's builder runs `ninja` from PATH
    build_dir = cache_root() / (tag if use_ninja else tag + "-direct")
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the temp directory still works (and says so in BUILD_DIR)
        import tempfile

        build_dir = Path(tempfile.gettempdir()) / "kimiserve-native" / build_dir.name
        build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        module = _build_ninja(name, build_dir, verbose) if use_ninja else _build_direct(name, build_dir, verbose)
    except NativeBuildFailed:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with what was being built and where
        raise NativeBuildFailed(f"building {SOURCE.name} in {build_dir} failed: {e}") from e
    module.BUILD_SECONDS = time.perf_counter() - start  # type: ignore[attr-defined]
    module.BUILD_DIR = str(build_dir)  # type: ignore[attr-defined]
    module.BUILT_WITH = "ninja" if use_ninja else "direct"  # type: ignore[attr-defined]
    _loaded["module"] = module
    return module


def _build_ninja(name: str, build_dir: Path, verbose: bool):
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        with_cuda=False,  # the CUDA driver API is loaded at run time: no toolkit needed
        build_directory=str(build_dir),
        verbose=verbose,
    )


def _build_direct(name: str, build_dir: Path, verbose: bool):
    """One `c++` call with torch's extension flags (no ninja); a .so already in `build_dir` is loaded as it is."""
    import importlib.util

    out = build_dir / f"{name}.so"
    # The directory's name pins the source, flags, torch and Python, and the .so appears by an atomic rename: one
    # that exists is complete and current. Loading it takes no lock, so a prebuilt read-only cache (the image) works.
    if not out.exists():
        _compile_direct(name, build_dir, out, verbose)
    spec = importlib.util.spec_from_file_location(name, out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _compile_direct(name: str, build_dir: Path, out: Path, verbose: bool) -> None:
    import fcntl
    import subprocess
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    with open(build_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per directory; the others wait and load its result
        if not out.exists():
            cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
            if cxx is None:
                raise NativeBuildFailed("building the native streaming engine needs a C++ compiler (c++ / g++ / $CXX)")
            abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
            cmd = [cxx, f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", "-fPIC", "-std=c++17",
                   *CFLAGS, *([f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}"] if abi is not None else []),
                   *[f"-isystem{p}" for p in cpp_extension.include_paths()],
                   f"-isystem{sysconfig.get_paths()['include']}", "-shared", str(SOURCE), "-o", str(out) + ".tmp",
                   *LDFLAGS, *[f"-L{p}" for p in cpp_extension.library_paths()],
                   "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
            if verbose:
                print(" ".join(cmd))
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise NativeBuildFailed(f"{' '.join(cmd[:2])} ... failed ({done.returncode}):\n{done.stderr[-4000:]}")
            os.replace(str(out) + ".tmp", out)


def main() -> int:
    module = load(verbose="-v" in sys.argv, use_ninja=False if "--direct" in sys.argv else None)
    print(f"native streaming engine ready in {module.BUILD_DIR} ({module.BUILT_WITH} build, "
          f"{module.BUILD_SECONDS:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
