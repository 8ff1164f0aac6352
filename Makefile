# `make up` serves the built-in tiny model; `make test` runs the whole suite, `make test-fast` the inner loop; `make soak`
# loads `kimiserve up` with mixed traffic for SOAK_MINUTES (60) and reports each service's RSS over time, errors and
# leaks at idle. All build .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test test-fast soak venv lock protos clean bench-gpu bench-decode train-gpu flashkda gpu-wheels

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build; 2.13.0 is the local CPU wheel.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# constraints.txt anew: the newest versions pyproject.toml's ranges allow, resolved in a throwaway venv. Review the
# diff and run `make test` before committing it.
LOCK_VENV ?= /tmp/kimiserve-lock-venv
lock:
	rm -rf $(LOCK_VENV)
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install -q -e '.[test]'
	head -n 5 constraints.txt > constraints.txt.new
	$(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^torch==' >> constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

up: $(STAMP)
	$(VENV)/bin/kimiserve up

# Three workers on two cores (TEST_WORKERS=N for more): each takes whole files, longest first (tests/conftest.py); the
# third fills the time the others wait on the stacks they start (544 s against 586 s with two, 2026-12-05).
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The inner loop, under 2 minutes on CI's machine: router logic, the tokenizer, engine invariants on tiny in-memory
# models, model pieces and the loader, Triton kernels in the interpreter; no process stacks beyond the tokenizer's
# own, and none of the tests marked slow (93-layer runs, kernels inside a whole model).
# tests/router/http and tests/router/batch start stacks: only the router's own test files.
FAST_TESTS := tests/router/test_*.py tests/tokenizer tests/engine tests/kernels tests/model tests/test_docs.py \
	tests/test_protos_fresh.py tests/test_tracing_config.py tests/test_constraints.py
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(FAST_TESTS)

# Not part of `make test` (launcher/soak.py; README "Soak"): `kimiserve up` with the trained default model on the
# CPU under mixed OpenAI-SDK and gRPC traffic at SOAK_RATE (2) requests/s; a table of each service's RSS over both
# halves of the load and at idle, outcomes and unexpected errors, JSON in SOAK_OUT (soak-report.json). Exit 1 when a
# service's RSS grows by 5 % or more over the second half, on an unexpected outcome, a held slot or block, or a restart.
SOAK_MINUTES ?= 60
soak: $(STAMP)
	SOAK_MINUTES=$(SOAK_MINUTES) $(PY) -m launcher.soak

# Every GPU benchmark of the README's Performance section, one folder each under BENCH_OUT, the served stack first
# (what a user meets), then the kernels. Runs with the GPU machine's own Python (torch with CUDA, Triton; fla-core and
# einops for the KDA comparison), not the CPU venv; the checkout goes in front of any PYTHONPATH already set (wheels
# installed with --target, say) rather than replacing it.
GPU_PY ?= python3
BENCH_OUT ?= bench_out
GPU_ENV = PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}
# FlashKDA, the KDA prefill anchor (CUTLASS, sm_90a), for bench/kda_kernels.py --k3: FLASHKDA_DIR is its repository
# with CUTLASS's include/, tools/util/include/ and examples/common/ under cutlass/ (a copy; the GPU machine cannot
# fetch the submodule), built in place there in about a minute. Without it the --k3 rows say FlashKDA is missing.
FLASHKDA_DIR ?=
# A GPU machine with torch and Triton but no package index: `make gpu-wheels` here downloads the rest for its Python
# into GPU_WHEELS (scripts/gpu_wheels.sh says what and how to install them there).
GPU_WHEELS ?= .cache/gpu-wheels
gpu-wheels:
	bash scripts/gpu_wheels.sh $(GPU_WHEELS)

flashkda:
	cd $(FLASHKDA_DIR) && FLASH_KDA_CUDA_ARCHS=90a NVCC_THREADS=16 $(GPU_PY) setup.py build_ext --inplace

bench-gpu:
	$(GPU_ENV) $(GPU_PY) -m bench.capacity --out $(BENCH_OUT)/capacity
	$(GPU_ENV) $(GPU_PY) -m bench.served --out $(BENCH_OUT)/served --auto-capacity --long-prompt 262144
	$(GPU_ENV) $(GPU_PY) -m bench.mla_prefill_long --out $(BENCH_OUT)/mla_prefill_long
	$(GPU_ENV)$(if $(FLASHKDA_DIR),:$(FLASHKDA_DIR)) $(GPU_PY) bench/kda_kernels.py --out $(BENCH_OUT)/kda --sweep \
		--profile --k3
	$(GPU_ENV) $(GPU_PY) -m bench.model_bench --out $(BENCH_OUT)/model --profile
	$(GPU_ENV) $(GPU_PY) -m bench.op_parity --out $(BENCH_OUT)/parity
	$(GPU_ENV) $(GPU_PY) -m bench.linear_micro --out $(BENCH_OUT)/linear
	$(GPU_ENV) $(GPU_PY) -m bench.small_ops --out $(BENCH_OUT)/small_ops
	$(GPU_ENV) $(GPU_PY) -m bench.mla_decode_sweep --out $(BENCH_OUT)/mla_decode
	$(GPU_ENV) $(GPU_PY) -m bench.streaming --out $(BENCH_OUT)/streaming --pinned-fraction 0.5
	$(GPU_ENV) $(GPU_PY) -m bench.trained_parity --out $(BENCH_OUT)/trained_parity

# The decode set of bench-gpu, run on its own while decode kernels change: the Triton kernel tests on the GPU first
# (each kernel against its eager reference, at the 48B shapes too; a failure is logged and the benchmarks still run),
# then the whole-model decode (fused ops, PDL on and off), the small ops with their sweeps, the decode linears and the
# trained-model parity (greedy tokens against eager).
bench-decode:
	mkdir -p $(BENCH_OUT)
	-$(GPU_ENV) $(GPU_PY) -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee $(BENCH_OUT)/kernel_tests.log
	$(GPU_ENV) $(GPU_PY) -m bench.model_bench --out $(BENCH_OUT)/model --profile
	$(GPU_ENV) $(GPU_PY) -m bench.small_ops --out $(BENCH_OUT)/small_ops --skip conv --sweep
	$(GPU_ENV) $(GPU_PY) -m bench.linear_micro --out $(BENCH_OUT)/linear
	$(GPU_ENV) $(GPU_PY) -m bench.trained_parity --out $(BENCH_OUT)/trained_parity

# Trains models/ from nothing (training/train.py; about six minutes on an H200) into TRAIN_OUT/<model>/, with the
# report in TRAIN_OUT/summary.json. Needs only torch, tokenizers, safetensors and numpy beside the checkout.
TRAIN_OUT ?= train_out
train-gpu:
	$(GPU_ENV) $(GPU_PY) -m training --out $(TRAIN_OUT)

protos: $(STAMP)
	$(PY) -m kimiserve.protogen

clean:
	rm -rf $(VENV)
