#!/usr/bin/env bash
# Wheels for a GPU machine that reaches no package index but has torch and Triton: everything else `make bench-gpu`
# and the services need, for its Python, downloaded here into one folder to copy there.
#   the project's runtime dependencies (pyproject.toml) but torch, triton and grpcio-tools, resolved for the target
#   pytest and pytest-timeout (`make bench-decode` runs the kernel tests there)
#   fla-core and einops, without their dependencies (fla's chunk_kda is the KDA comparison; its torch is the GPU's)
# Usage: scripts/gpu_wheels.sh [DIR]   (default .cache/gpu-wheels; GPU_PYTHON=3.12 names the target's Python)
# There: pip install --no-index --no-deps --target /tmp/site DIR/*.whl, then PYTHONPATH=/tmp/site make bench-gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.cache/gpu-wheels}"
target=(--only-binary=:all: --implementation cp --python-version "${GPU_PYTHON:-3.12}"
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)  # pip matches these tags exactly
mapfile -t runtime < <(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    name = re.match(r"[A-Za-z0-9_.-]+", dep)[0].lower()
    if name not in ("torch", "triton", "grpcio-tools"):
        print(dep.split(";")[0].strip())
PY
)
mkdir -p "$out"
python3 -m pip download -q "${target[@]}" -d "$out" "${runtime[@]}" "pytest>=8,<10" "pytest-timeout>=2.3,<3"
python3 -m pip download -q "${target[@]}" --no-deps -d "$out" "fla-core==0.6.0" "einops>=0.8,<1"
if ls "$out" | grep -E '^(torch|triton|nvidia)' >/dev/null; then
  echo "gpu_wheels: a wheel the GPU machine already has was pulled in: $(ls "$out" | grep -E '^(torch|triton|nvidia)')" >&2
  exit 1
fi
echo "gpu_wheels: $(ls "$out" | wc -l) wheels in $out ($(du -sh "$out" | cut -f1))"
