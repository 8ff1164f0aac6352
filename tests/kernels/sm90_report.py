"""Registers, spill stack and shared memory of every kernel launch the sm_90 compile test records, compiled on this
machine as a GPU launch at the recorded shapes would be (tests/kernels/sm90.py). A CPU proxy to read before a GPU
session: the registers a kernel holds decide how many of its programs share a multiprocessor, and a spill is local
memory traffic. It times nothing.

    python -m tests.kernels.sm90_report [--match NAME] [--sass] [--out DIR]

prints a line per launch and writes sm90_resources.json in DIR. --sass adds each kernel's SASS instruction count and
mix, and its loops' bodies: a body times its trip count (a channel-slice loop runs K / slice times, for example)
estimates the instructions a program runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

REGISTERS_PER_SM = 65536


def resident_programs(registers: int, warps: int) -> int:
    """Programs of a kernel one multiprocessor holds at once as far as registers go (allocated per warp in units
    of 256), at most 32."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(32, REGISTERS_PER_SM // (per_warp * warps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match", default="", help="only kernels whose name contains this")
    ap.add_argument("--out", default=None, help="directory for sm90_resources.json")
    ap.add_argument("--sass", action="store_true", help="also the SASS instruction mix and loop bodies")
    a = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"
    if a.sass:
        os.environ["SM90_SASS"] = "1"  # read by the compile process
    from tests.kernels.sm90 import compile_all
    from tests.kernels.test_sm90_compile import every_launch

    chosen = [s for s in every_launch() if a.match in s["name"]]
    with tempfile.TemporaryDirectory() as tmp:
        results = compile_all(chosen, tmp)
    rows = []
    for r in sorted(results, key=lambda r: r["name"]):
        warps = r["options"].get("num_warps", 4)
        shape = {k: v for k, v in r["constexprs"].items() if k.isupper() and isinstance(v, (int, str)) and k != "PDL"}
        rows.append({**r, "warps": warps, "programs_per_sm": resident_programs(r["registers"], warps)
                     if r["registers"] else None, "shape": shape})
        print(f"{r['name']:<36} w{warps} s{r['options'].get('num_stages', 3)} regs {r['registers']!s:>4} "
              f"stack {r['stack']!s:>5} shared {r['shared']!s:>6}  "
              f"{'ERROR ' + r['error'][:80] if r['error'] else json.dumps(shape)[:150]}")
        if "sass" in r:
            print(f"    sass {json.dumps({k: v for k, v in r['sass'].items() if k != 'loops'})}")
            for n, loop in enumerate(r["sass"]["loops"]):
                print(f"    loop {n}: {json.dumps(loop)}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "sm90_resources.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
