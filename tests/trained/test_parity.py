"""Every fast or distributed path gives the eager reference's greedy tokens (TOKENS of them for each chat prompt) on the
trained models: weight streaming through the native ring, host KV offload under a KV cache too small for the batch,
and a TP=2 shard group. The Triton kernels run in Triton's CPU interpreter, which executes each kernel launch in
Python (about 2 s of CPU per Kimi-Linear decode step, ~25 s per 93-layer K3 one): there the check is a short prompt's
logits at every position and its first TRITON_DECODE_TOKENS greedy tokens, on both trained models."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from prometheus_client import CollectorRegistry

from kimiserve.tokenizer_files.loading import load_tokenizer
from shard_svc.config import ModelConfig
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.ops import select_ops
from shard_svc.state.kv_offload import HostKVProfile
from shard_svc.weight_streaming import StreamingMetrics, StreamOptions, WeightStreamer
from shard_svc.weight_streaming.host_loader import load_streamed
# Imported at collection, before anything imports Triton compiled: decorates the kernels for Triton's CPU interpreter
# (tests/kernels/conftest.py); Triton cannot be imported a second time in one process.
import tests.kernels.conftest  # noqa: F401
from tests.trained.conftest import (BLOCK, CPU, K3, LINEAR, PROMPTS, TOKENS, assert_same_tokens, chat_ids,
                                    engine_for, generate, model_dir)

# The exact paths (streaming, offload, TP) are checked on random 93-layer K3s elsewhere (tests/engine, tests/parallel);
# the trained K3 is here for the kernels. Its 92 layers of top-k routing turn a rounding anywhere into other tokens
# over long inputs (README, Trained models), but on a 5-token prompt in fp32 the kernels hold its logits to 1.2e-6.
MODELS = [LINEAR]
KERNEL_MODELS = [LINEAR, K3]
# Under the interpreter a pass costs by its launches, not its tokens: the 93-layer K3's ~1,400 take ~25 s a pass, so
# it gets a short prompt and one decode step (the first token comes from the prefill pass).
INTERPRETER_PROMPT = "Once upon a time"
TRITON_DECODE_TOKENS = {LINEAR: 4, K3: 2}
LOGITS_TOL = 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_weight_streaming_gives_the_reference_tokens(name, reference):
    path = model_dir(name)
    cfg, model, host = load_streamed(path, CPU, torch.float32)
    streamer = WeightStreamer(cfg, model, host, CPU, StreamOptions(prefetch_depth=2))
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU,
                    EngineConfig(num_state_slots=PROMPTS[name], num_kv_blocks=64, kv_block_size=BLOCK,
                                 prefill_token_budget=512))
    streamer.attach(engine.runner)
    assert_same_tokens(reference(name), generate(engine, chat_ids(path), TOKENS[name]), "weight streaming",
                       logits_tol=0.0)


@pytest.mark.parametrize("name", MODELS)
def test_host_kv_offload_gives_the_reference_tokens(name, reference):
    """A device cache of 4-token blocks that holds the first two prompts and two more blocks (at least one whole
    sequence, the context limit): as sequences decode they outgrow it, so the scheduler moves whole sequences to the
    host pool and back."""
    path = model_dir(name)
    prompts = chat_ids(path)
    block = 4
    blocks = [-(-len(p) // block) for p in prompts]
    promises = [-(-(len(p) + TOKENS[name]) // block) for p in prompts]
    registry = CollectorRegistry()
    page = HostKVProfile.from_config(ModelConfig.from_dir(path)).page_bytes(block, torch.float32)
    engine = engine_for(path, kv_metrics=StreamingMetrics(registry, "kv"), kv_block_size=block,
                        num_kv_blocks=max(blocks[0] + blocks[1] + 2, max(promises)), host_kv_bytes=sum(promises) * page)
    # Offloaded sequences decode in other batch compositions than the reference's: equal tokens, logits to fp32 sums.
    assert_same_tokens(reference(name), generate(engine, prompts, TOKENS[name]), "host KV offload", logits_tol=1e-5)
    moved = registry.get_sample_value("kimiserve_kv_pages_offloaded_total", {"shard": "kv", "rank": "0"})
    assert moved and moved > 0, "the small cache never offloaded a sequence: the test did not test offload"


@pytest.mark.parametrize("name", MODELS)
def test_tp2_shard_group_gives_the_reference_tokens(name, reference):
    """`kimiserve generate --tp 2`: two gloo ranks, attention heads and experts split in two."""
    path = model_dir(name)
    prompt = chat_ids(path)[0]
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", "--model", str(path), "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-tokens", str(TOKENS[name]), "--ignore-eos", "--tp", "2",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])["token_ids"]
    ref = reference(name).tokens[0]
    first = next((j for j, (x, y) in enumerate(zip(ref, got)) if x != y), None)
    assert got == ref, f"TP=2 differs from the reference at token {first}"


@pytest.mark.parametrize("name", KERNEL_MODELS)
def test_triton_kernels_in_the_interpreter_give_the_reference_tokens(name, monkeypatch):
    """The interpreter computes in float32 as eager does, so beyond the greedy tokens the logits must agree to
    float32 sums (~4e-7 of the largest on Kimi-Linear, 1.2e-6 on K3): a kernel that is wrong anywhere in the model
    moves them."""
    from tests.kernels.test_linear import linear_module
    from tests.kernels.test_mla_decode import mla_module
    from tests.kernels.test_moe_experts import moe_module

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    moe_module(), mla_module(), linear_module()  # decorated in interpreter mode (tests/kernels/conftest.py)
    path = model_dir(name)
    ops = select_ops(CPU, "triton")
    assert dict(ops.backends)["kda_prefill"] == "triton" and dict(ops.backends)["mla_decode"] == "triton"
    prompt = load_tokenizer(path).encode(INTERPRETER_PROMPT)
    tokens = TRITON_DECODE_TOKENS[name]
    ref = generate(engine_for(path, num_state_slots=1), [prompt], tokens)
    got = generate(engine_for(path, ops, num_state_slots=1), [prompt], tokens)
    assert got.prompt_logits[0].argmax(-1).tolist() == ref.prompt_logits[0].argmax(-1).tolist(), \
        "Triton prefill: another argmax at some prompt position"
    err = float((got.prompt_logits[0] - ref.prompt_logits[0]).abs().max() / ref.prompt_logits[0].abs().max())
    assert err <= LOGITS_TOL, f"Triton prefill: prompt logits differ by {err:.2e} of the largest"
    assert_same_tokens(ref, got, "Triton decode", logits_tol=LOGITS_TOL)
