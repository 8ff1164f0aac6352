"""Parity with transformers' KimiLinearForCausalLM, an independent implementation, on the CPU in float32.

transformers runs without fla here: its KDA falls back to pure-PyTorch chunked (prefill) and recurrent (decode)
loops and its short conv to F.conv1d. Each case builds a tiny random transformers model with a fixed seed,
randomises every parameter and buffer (norm weights, A_log, dt_bias, router biases included), writes it with
`save_pretrained` (the published tensor names: q/k/v_conv1d, f_a/f_b, A_log, experts.{e}.w1/w2/w3, dense layers
under block_sparse_moe.), loads it with our `load_model`, and compares prompt logits and 12 greedy tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
# A test dependency (pyproject's [test] extra), imported plainly: this is the only check against an independent
# implementation, so a missing transformers fails the suite instead of skipping it.
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops

CPU = torch.device("cpu")
REL = 1e-4  # max |ours - ref| / max |ref| over all compared logits
NEW_TOKENS = 12


def hf_config(*, layers, mla, dense, vocab=256, hidden=32, mla_heads=2, kda_heads=2, head_dim=8, experts=6,
              top_k=2, shared=1, q_lora=None, nope=8, rope=4, v_dim=8, kv_lora=16, renormalize=True,
              scaling=2.446, moe_inter=16, inter=48) -> KimiLinearConfig:
    """`mla`: 1-based MLA layers (the checkpoint convention); every other layer is KDA."""
    return KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=moe_inter,
        num_hidden_layers=layers, num_attention_heads=mla_heads, num_key_value_heads=mla_heads,
        kv_lora_rank=kv_lora, q_lora_rank=q_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
        num_experts=experts, num_experts_per_token=top_k, num_shared_experts=shared, first_k_dense_replace=dense,
        routed_scaling_factor=scaling, moe_renormalize=renormalize, rms_norm_eps=1e-5,
        linear_attn_config={"num_heads": kda_heads, "head_dim": head_dim, "short_conv_kernel_size": 4,
                            "full_attn_layers": mla, "kda_layers": [i for i in range(1, layers + 1) if i not in mla]},
        pad_token_id=None, bos_token_id=None, eos_token_id=vocab - 1, tie_word_embeddings=False,
        attn_implementation="eager", dtype="float32")


CASES = {
    # (config, prompt length)
    "mla-last": (dict(layers=4, mla=[4], dense=1), 23),
    "mla-first-two-dense-prompt-over-64": (
        dict(layers=5, mla=[1], dense=2, mla_heads=4, kda_heads=3, experts=8, top_k=3, shared=2), 70),
    "mla-mid-and-last-q-lora-wide-heads": (
        dict(layers=6, mla=[3, 6], dense=1, hidden=48, mla_heads=3, kda_heads=4, head_dim=16, experts=16, top_k=4,
             q_lora=20, nope=16, rope=8, v_dim=12, kv_lora=24, scaling=1.5, vocab=320), 41),
    "top-1-unnormalised": (dict(layers=4, mla=[2], dense=1, experts=4, top_k=1, renormalize=False, scaling=1.0), 33),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer to seeded random values, norms and router biases included."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, t in sorted(tensors.items()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                value = torch.log(torch.rand(t.shape, generator=gen) * 15 + 1)
            elif leaf == "dt_bias":
                value = torch.randn(t.shape, generator=gen)
            elif leaf == "e_score_correction_bias":
                value = torch.randn(t.shape, generator=gen) * 0.2  # comparable to the spread of sigmoid scores
            elif "norm" in name and t.dim() == 1:
                value = 1 + 0.3 * torch.randn(t.shape, generator=gen)
            elif "embed_tokens" in name:
                value = torch.randn(t.shape, generator=gen)
            else:  # projections, conv taps, fused experts [E, out, in], router
                value = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1])
            t.copy_(value)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def pair(request, tmp_path_factory):
    """(case, HF model, our engine) built from one saved checkpoint."""
    kwargs, prompt_len = CASES[request.param]
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(hf_config(**kwargs)).eval()
    randomise(hf, seed=sum(map(ord, request.param)))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    cfg, model = load_model(path, device="cpu", dtype=torch.float32)
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(num_state_slots=2, num_kv_blocks=64))
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    return request.param, hf, engine, prompt, path


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).abs().max() / ref.double().abs().max())


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids]), use_cache=False).logits[0].float()


def test_checkpoint_uses_published_names(pair):
    """What save_pretrained wrote is the published layout our loader reads (not transformers' fused runtime one)."""
    from safetensors import safe_open
    _, _, _, _, path = pair
    with safe_open(path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names  # dense layer 0, transformers' spelling
    assert any(n.endswith("self_attn.q_conv1d.weight") for n in names)
    assert any(n.endswith("block_sparse_moe.experts.0.w1.weight") for n in names)
    assert not any("conv1d.weight" in n and "_conv1d" not in n for n in names)
    assert not any("forget_gate" in n or "gate_up_proj" in n for n in names)
    assert json.loads((path / "config.json").read_text())["model_type"] == "kimi_linear"


def test_prompt_logits_match_transformers(pair):
    case, hf, engine, prompt, _ = pair
    ref = hf_logits(hf, prompt)
    seq = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), f"{case}-prompt",
                          keep_prompt_logits=True)
    ours = torch.cat(seq.prompt_logits)
    assert ours.shape == ref.shape
    err = rel_err(ours, ref)
    print(f"{case}: prompt logits max rel err {err:.2e}")
    assert err <= REL, f"{case}: prompt logits max |ours - transformers| / max |transformers| = {err:.2e}"


def test_greedy_tokens_match_transformers(pair):
    """12 greedy tokens: our prefill + decode (carried KDA state and MLA cache) vs transformers' full forward
    over the whole sequence at every step; the logits each token was drawn from must agree too."""
    case, hf, engine, prompt, _ = pair
    seq = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                 ignore_eos=True), f"{case}-greedy",
                          keep_prompt_logits=True)
    ids, ref_tokens, ref_rows = list(prompt), [], []
    for _ in range(NEW_TOKENS):
        row = hf_logits(hf, ids)[-1]
        ref_rows.append(row)
        ref_tokens.append(int(row.argmax()))
        ids.append(ref_tokens[-1])
    assert seq.output == ref_tokens, f"{case}: greedy tokens differ"
    err = rel_err(torch.cat(seq.step_logits), torch.stack(ref_rows))
    print(f"{case}: step logits max rel err {err:.2e}")
    assert err <= REL, f"{case}: step logits max |ours - transformers| / max |transformers| = {err:.2e}"


def test_parity_sees_the_routing_convention(pair, monkeypatch):
    """The cases are sensitive to the MoE weight convention: with the original remote code's bias-included weights
    (docs/models.md#routing) our logits leave the transformers tolerance, so the parity above really checks it."""
    case, hf, engine, prompt, _ = pair
    from shard_svc.ops.moe import eager

    def biased_weights(x, gate_weight, bias, top_k, renormalize, scaling):
        scores = torch.sigmoid(x.float() @ gate_weight.float().t()) + bias.float()
        ids = torch.topk(scores, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * scaling, ids

    assert engine.runner.ops.moe_route is eager.moe_route
    monkeypatch.setattr(engine.runner, "ops", dataclasses.replace(engine.runner.ops, moe_route=biased_weights))
    seq = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), f"{case}-biased",
                          keep_prompt_logits=True)
    err = rel_err(torch.cat(seq.prompt_logits), hf_logits(hf, prompt))
    assert err > 100 * REL, f"{case}: bias-included routing weights stay within {err:.1e} of transformers"
