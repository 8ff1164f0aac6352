# `make up` serves the built-in tiny model; `make test` runs the whole suite, `make test-fast` the inner loop; `make soak`
# loads a stack with a random mix of good, invalid, cancelled and disconnected requests for SOAK_MINUTES (5) and
# reports leaks. All build .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test test-fast soak venv protos clean bench-gpu train-gpu

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build; 2.13.0 is the local CPU wheel.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/kimiserve up

# Two workers (TEST_WORKERS=N for more cores), each taking whole files, longest first (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The inner loop, under 2 minutes on CI's machine: router logic, the tokenizer, engine invariants on tiny in-memory
# models, model pieces and the loader, Triton kernels in the interpreter; no process stacks beyond the tokenizer's
# own, and none of the tests marked slow (93-layer runs, kernels inside a whole model).
# tests/router/http and tests/router/batch start stacks: only the router's own test files.
FAST_TESTS := tests/router/test_*.py tests/tokenizer tests/engine tests/kernels tests/model tests/test_docs.py \
	tests/test_protos_fresh.py tests/test_tracing_config.py
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(FAST_TESTS)

# Not part of `make test`. Exit 1 if a slot or KV block leaked or a request ended other than its kind allows;
# the report goes to SOAK_OUT (soak-report.json). Knobs: SOAK_MINUTES, SOAK_CONCURRENCY, SOAK_FAMILY, SOAK_SEED.
SOAK_MINUTES ?= 5
soak: $(STAMP)
	SOAK_MINUTES=$(SOAK_MINUTES) $(PY) -m tests.reliability.soak

# Every GPU benchmark of the README's Performance section, one folder each under BENCH_OUT. Runs with the GPU
# machine's own Python (torch with CUDA, Triton; fla-core and einops for the KDA comparison), not the CPU venv.
GPU_PY ?= python3
BENCH_OUT ?= bench_out
bench-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) bench/kda_kernels.py --out $(BENCH_OUT)/kda --sweep --profile
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.model_bench --out $(BENCH_OUT)/model --profile
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.op_parity --out $(BENCH_OUT)/parity
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.linear_micro --out $(BENCH_OUT)/linear
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.small_ops --out $(BENCH_OUT)/small_ops
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.mla_decode_sweep --out $(BENCH_OUT)/mla_decode
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.streaming --out $(BENCH_OUT)/streaming --pinned-fraction 0.5
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.trained_parity --out $(BENCH_OUT)/trained_parity
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.capacity --out $(BENCH_OUT)/capacity
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.served --out $(BENCH_OUT)/served --auto-capacity --long-prompt 262144

# Trains models/ from nothing (training/train.py; about six minutes on an H200) into TRAIN_OUT/<model>/, with the
# report in TRAIN_OUT/summary.json. Needs only torch, tokenizers, safetensors and numpy beside the checkout.
TRAIN_OUT ?= train_out
train-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m training --out $(TRAIN_OUT)

protos: $(STAMP)
	$(PY) -m kimiserve.protogen

clean:
	rm -rf $(VENV)
