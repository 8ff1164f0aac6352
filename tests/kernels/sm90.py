"""Every Triton kernel compiled for sm_90 (H100 / H200) on a machine without a GPU: the launches a run makes under
the CPU interpreter are recorded (kernel, argument types, constexprs, warps, stages), then compiled ahead of time by
Triton's own compiler and the ptxas bundled with it, in a fresh process where the kernels are not interpreted.

A kernel that interprets fine can still fail to compile (a construct the interpreter accepts and the code generator
does not, a register or shared-memory budget blown by the tile sizes); this catches those before a GPU session.
Each spec carries the alignment hints a GPU launch would give it (Triton specializes pointers and integers divisible
by 16), so the code compiled here is the code a launch at the recorded shapes runs, and each result reports the
registers and spill stack ptxas gave it (`cuobjdump -res-usage`).

    python -m tests.kernels.sm90 SPECS.json    # compiles each spec, one JSON line per spec on stdout
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import torch

SM90 = ("cuda", 90, 32)  # Hopper, warp size 32
SHARED_MEMORY_LIMIT = 232448  # bytes a block may use on sm_90 (227 KB)
# constexprs that take another value on a Hopper GPU than under the interpreter (ops/triton/common.py: interpreting,
# pdl_args): compiled with their GPU value
GPU_VALUES = {"DOT_FP32": False, "RNE": False, "PDL": True}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
         torch.bool: "i1"}


def launch_spec(fn, args: tuple, kwargs: dict) -> dict:
    """One interpreted launch as {module, name, signature, constexprs, options}."""
    params = list(inspect.signature(fn).parameters.values())
    names = {p.name for p in params}
    values = dict(zip((p.name for p in params), args))
    values.update((k, v) for k, v in kwargs.items() if k in names)
    signature, constexprs, divisible = {}, {}, []
    for p in params:
        v = values.get(p.name, p.default)
        if "constexpr" in str(p.annotation) or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = GPU_VALUES.get(p.name, getattr(v, "value", v))
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                divisible.append(p.name)
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                divisible.append(p.name)
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(v).__name__} has no Triton type here")
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    if "PDL" in constexprs:
        options["launch_pdl"] = constexprs["PDL"]
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
            "divisible": divisible, "options": options}


@contextlib.contextmanager
def recorded_launches(execute: bool = True) -> Iterator[list[dict]]:
    """Records every interpreted kernel launch (deduplicated) into the yielded list. execute=False skips running
    them: enough for graph-safe ops (they never read a kernel's output back on the host), at full model sizes."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    specs: list[dict] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        spec = launch_spec(self.fn, args, kwargs)
        key = json.dumps(spec, sort_keys=True)
        if key not in seen:
            seen[key] = spec
            specs.append(spec)
        if execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    InterpretedFunction.run = run
    try:
        yield specs
    finally:
        InterpretedFunction.run = original


def compile_all(specs: list[dict], cache_dir: str, timeout: float = 600) -> list[dict]:
    """Compiles the specs in a fresh process (kernels decorated for the GPU, Triton's cache in cache_dir); one result
    per spec: {name, constexprs, options, error or None, shared (bytes of shared memory), registers and stack (bytes
    of spill stack per thread; None where cuobjdump is missing)}."""
    path = os.path.join(cache_dir, "specs.json")
    with open(path, "w") as f:
        json.dump(specs, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = cache_dir
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-m", "tests.kernels.sm90", path], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    if out.returncode != 0:
        raise RuntimeError(f"the sm_90 compile process failed ({out.returncode}): {out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def cuobjdump(cubin: bytes, cache_dir: str, flag: str) -> str | None:
    """`cuobjdump flag` of a compiled kernel with the cuobjdump bundled with Triton (None where it is missing)."""
    import triton.backends.nvidia

    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    path = os.path.join(cache_dir, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout


def resource_usage(cubin: bytes, cache_dir: str) -> tuple[int | None, int | None]:
    """(registers per thread, spill stack bytes per thread) of a compiled kernel."""
    found = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(cubin, cache_dir, "-res-usage") or "")
    return (int(found[1]), int(found[2])) if found else (None, None)


SASS_CLASSES = ("HMMA", "HGMMA", "MUFU", "SHFL", "LDS", "STS", "LDSM", "STSM", "LDG", "LDGSTS", "STG", "BAR", "LDL",
                "STL")


def sass_loops(cubin: bytes, cache_dir: str) -> dict:
    """The kernel's SASS: its instruction count and mix, and each loop (a backward branch) with its body's. A loop's
    body times its trip count (which the SASS does not say) estimates what the loop runs."""
    text = cuobjdump(cubin, cache_dir, "-sass") or ""
    ins = [(int(m[1], 16), m[2].split(".")[0], m[3]) for m in
           re.finditer(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", text)]
    index = {addr: i for i, (addr, _, _) in enumerate(ins)}

    def mix(part) -> dict:
        ops = collections.Counter(op for _, op, _ in part)
        return {"instructions": len(part), **{c: ops[c] for c in SASS_CLASSES if ops[c]}}

    loops = []
    for i, (addr, op, rest) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target[1], 16) < addr and int(target[1], 16) in index:
            loops.append(mix(ins[index[int(target[1], 16)]:i + 1]))
    return {**mix(ins), "loops": loops}


def main(path: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for spec in json.load(open(path)):
        fn = getattr(importlib.import_module(spec["module"]), spec["name"])
        names = list(spec["signature"])
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.get("divisible", [])}
        result = {"name": spec["name"], "constexprs": spec["constexprs"], "options": spec["options"], "error": None,
                  "shared": None, "registers": None, "stack": None}
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"],
                                              attrs=attrs), target=GPUTarget(*SM90), options=spec["options"])
            result["shared"] = kernel.metadata.shared
            result["registers"], result["stack"] = resource_usage(kernel.asm["cubin"], os.path.dirname(path))
            if os.environ.get("SM90_SASS"):
                result["sass"] = sass_loops(kernel.asm["cubin"], os.path.dirname(path))
        except Exception as e:  # noqa: BLE001 - reported per spec; the test names them all
            result["error"] = f"{type(e).__name__}: {str(e)[-1500:]} {e.__cause__!r}"
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
