"""K3 pieces, one by one, against the spec references in tests/model/refs.py (docs/models.md#kimi-k3).

Every expected value comes from refs.py or is computed by hand here; the model code only ever produces the
`actual` side. Tiny random models come from tests/engine/conftest.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from shard_svc.config import ModelConfig
from shard_svc.forward_batch import ForwardBatch, ForwardContext
from shard_svc.model.attn_res import AttnResMix, BlockCarry
from shard_svc.ops import select_ops
from shard_svc.ops.activations import glu
from shard_svc.ops.kda.eager import kda_prefill
from shard_svc.ops.kda.gate import kda_gate
from shard_svc.ops.kda.naive import naive_kda_varlen
from shard_svc.ops.moe.eager import moe_route
from shard_svc.state.pools import KDAStatePool, MLAKVCache
from tests.engine.conftest import k3_config, linear_config, random_model
from tests.model import refs

CPU = torch.device("cpu")
OPS = select_ops(CPU, "eager")
EPS = 1e-5  # rms_norm_eps of the tiny configs
# MLA's q_a_layernorm / kv_a_layernorm: the model authors' code (and transformers) use the norm's default 1e-6,
# not rms_norm_eps; see shard_svc/model/mla.py.
MLA_LATENT_EPS = 1e-6
BOUNDARIES_93 = [0, 12, 24, 36, 48, 60, 72, 84]  # blocks of 12 open here: docs/models.md#block-attention-residuals


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max())


def assert_close(actual, expected, rel=1e-5, what=""):
    err = rel_err(actual, expected)
    assert err <= rel, f"{what}: max |diff| / max |expected| = {err:.2e} > {rel:.0e}"


def one_sequence_ctx(cfg: ModelConfig, n: int, block_size: int = 16, dtype=torch.float32) -> ForwardContext:
    """Fresh pools and a prefill batch of one sequence of n tokens in slot 0, cache blocks 0..."""
    blocks = -(-n // block_size)
    batch = ForwardBatch(
        cu_seqlens=torch.tensor([0, n]), ctx_lens=torch.tensor([0]), state_slots=torch.tensor([0]),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], slot_mapping=torch.arange(n), is_decode=False)
    return ForwardContext(batch, KDAStatePool(cfg, 1, CPU, dtype), MLAKVCache(cfg, blocks, block_size, CPU, dtype),
                          OPS)


def tokens(n: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def k3_26():
    return random_model(k3_config(26), seed=3)


@pytest.fixture(scope="module")
def k3_93():
    return random_model(k3_config(93), seed=4)


# -- weights of our modules as plain tensors for refs.py ---------------------------------------------------------------
def weight_of(module, name: str):
    return getattr(getattr(module, name, None), "weight", None)


def kda_weights(attn) -> refs.KDAWeights:
    w = lambda name: weight_of(attn, name)  # noqa: E731
    return refs.KDAWeights(
        q=w("q_proj"), k=w("k_proj"), v=w("v_proj"), q_conv=attn.q_conv1d.weight.squeeze(1),
        k_conv=attn.k_conv1d.weight.squeeze(1), v_conv=attn.v_conv1d.weight.squeeze(1), f_a=w("f_a_proj"),
        f_b=w("f_b_proj"), b=w("b_proj"), o_norm=w("o_norm"), o=w("o_proj"), a_log=attn.A_log,
        dt_bias=attn.dt_bias, g_full=w("g_proj"), g_a=w("g_a_proj"), g_b=w("g_b_proj"))


def mla_weights(attn) -> refs.MLAWeights:
    w = lambda name: weight_of(attn, name)  # noqa: E731
    return refs.MLAWeights(kv_a=w("kv_a_proj_with_mqa"), kv_a_norm=w("kv_a_layernorm"), kv_b=w("kv_b_proj"),
                           o=w("o_proj"), q=w("q_proj"), q_a=w("q_a_proj"), q_a_norm=w("q_a_layernorm"),
                           q_b=w("q_b_proj"), g=w("g_proj"))


def moe_weights(block) -> refs.MoEWeights:
    sh = getattr(block, "shared_experts", None)
    w = lambda name: weight_of(block, name)  # noqa: E731
    return refs.MoEWeights(
        gate=block.gate.weight, bias=block.gate.e_score_correction_bias, w1=block.experts.w1, w3=block.experts.w3,
        w2=block.experts.w2, shared=None if sh is None else (sh.gate_proj.weight, sh.up_proj.weight,
                                                             sh.down_proj.weight),
        latent_down=w("routed_expert_down_proj"), latent_up=w("routed_expert_up_proj"),
        latent_norm=w("routed_expert_norm"))


def act_of(cfg: ModelConfig):
    if cfg.activation == "situ":
        return lambda g, u: refs.situ_glu(g, u, cfg.situ_beta, cfg.situ_linear_beta)
    return refs.swiglu


# -- AttnRes mix ---------------------------------------------------------------------------------------------------
def test_attn_res_hand_computed():
    """D=2, unit norm weight, eps 0. B_0=[1,1] -> key [1,1]; cur=[2,0] -> key [sqrt2,0]; proj=[0, ln3]:
    scores (ln3, 0) -> probs (3/4, 1/4) -> 3/4*[1,1] + 1/4*[2,0] = [1.25, 0.75] (raw values mixed)."""
    mix = AttnResMix(2, 0.0, torch.float32)
    mix.norm.weight.data = torch.ones(2)
    mix.proj.weight.data = torch.tensor([[0.0, math.log(3.0)]])
    out = mix(torch.tensor([[2.0, 0.0]]), torch.tensor([[[1.0, 1.0]]]), OPS)
    torch.testing.assert_close(out, torch.tensor([[1.25, 0.75]]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n_blocks", [0, 1, 3, 8], ids=lambda n: f"{n}-blocks")
def test_attn_res_mix_matches_reference(n_blocks):
    gen = torch.Generator().manual_seed(n_blocks)
    d, t = 16, 5
    mix = AttnResMix(d, EPS, torch.float32)
    mix.norm.weight.data = 1 + 0.5 * torch.randn(d, generator=gen)
    mix.proj.weight.data = torch.randn(1, d, generator=gen)
    # Sources of very different scales, so normalising keys (and not values) matters.
    scales = torch.tensor([3.0**i for i in range(n_blocks)]).view(-1, 1, 1)
    blocks = torch.randn(n_blocks, t, d, generator=gen) * scales
    cur = torch.randn(t, d, generator=gen)
    out = mix(cur, blocks, OPS)
    expected = refs.attn_res(cur, list(blocks), mix.norm.weight, mix.proj.weight, EPS)
    assert_close(out, expected, 1e-6, "AttnRes")
    if n_blocks == 0:
        assert torch.equal(out, cur), "a mix over the current value alone must return it unchanged"


def test_block_carry_is_preallocated_for_every_boundary():
    like = torch.zeros(3, 4)
    carry = BlockCarry(93, 12, like)
    assert carry.buf.shape == (8, 3, 4), "93 layers, block size 12: 8 summaries (layers 0, 12, ..., 84)"
    ptr = carry.buf.data_ptr()
    opened = [layer for layer in range(93) if carry.opens_block(layer)]
    for layer in opened:
        carry.append(torch.full((3, 4), float(layer)))
    assert opened == BOUNDARIES_93
    assert carry.count == 8 and carry.buf.data_ptr() == ptr, "the carry must not be reallocated while filling"
    assert [int(b[0, 0]) for b in carry.filled()] == BOUNDARIES_93


# -- the whole K3 residual path ----------------------------------------------------------------------------------------
def dtype_of(model) -> torch.dtype:
    return model.model.embed_tokens.weight.dtype


def ours_hidden(cfg, model, ids):
    with torch.inference_mode():
        return model(ids, one_sequence_ctx(cfg, len(ids), dtype=dtype_of(model)))


def our_mix(module) -> refs.Mix:
    """One of our AttnResMix modules as a refs.Mix (the mix itself is checked against refs.attn_res above)."""
    return lambda cur, blocks: module(cur, torch.stack(blocks) if blocks else cur.new_empty(0, *cur.shape), OPS)


def spec_mix(module) -> refs.Mix:
    return refs.attn_res_with(module.norm.weight, module.proj.weight, EPS)


def reference_layers(cfg, model, ctx, independent: bool) -> list[refs.K3Layer]:
    """The residual path and the carry are refs.k3_forward's own. Mixers, ffns and mixes are our modules, or with
    `independent` refs.py's versions on our weights."""
    out = []
    for layer in model.model.layers:
        if independent:
            out.append(refs.K3Layer(independent_mixer(cfg, layer), independent_ffn(cfg, layer),
                                    spec_mix(layer.self_attention_res), spec_mix(layer.mlp_res)))
        else:
            out.append(refs.K3Layer(lambda x, layer=layer: layer.mixer(x, ctx),
                                    lambda x, layer=layer: layer.ffn(x, ctx),
                                    our_mix(layer.self_attention_res), our_mix(layer.mlp_res)))
    return out


def independent_mixer(cfg, layer):
    attn, norm_w = layer.self_attn, layer.input_layernorm.weight
    if cfg.layer_kinds[layer.idx] == "kda":
        return lambda x: refs.kda_layer(refs.rms_norm(x, norm_w, EPS), kda_weights(attn), cfg.kda.num_heads,
                                        cfg.kda.head_dim, cfg.kda.gate_lower_bound, EPS)
    m = cfg.mla
    return lambda x: refs.mla_layer(refs.rms_norm(x, norm_w, EPS), mla_weights(attn), m.num_heads,
                                    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, MLA_LATENT_EPS)


def independent_ffn(cfg, layer):
    norm_w, act = layer.post_attention_layernorm.weight, act_of(cfg)
    if hasattr(layer, "mlp"):
        mlp = layer.mlp
        return lambda x: refs.gated_mlp(refs.rms_norm(x, norm_w, EPS), mlp.gate_proj.weight, mlp.up_proj.weight,
                                        mlp.down_proj.weight, act)
    m = cfg.moe
    return lambda x: refs.moe(refs.rms_norm(x, norm_w, EPS), moe_weights(layer.block_sparse_moe), m.top_k,
                              m.renormalize, m.routed_scaling_factor, act, EPS)


def reference_hidden(cfg, model, ids, independent=False, **kw) -> refs.K3Trace:
    ctx = one_sequence_ctx(cfg, len(ids), dtype=dtype_of(model))
    out_mix = model.model.output_attn_res
    with torch.inference_mode():
        return refs.k3_forward(
            model.model.embed_tokens(ids), reference_layers(cfg, model, ctx, independent),
            spec_mix(out_mix) if independent else our_mix(out_mix),
            lambda h: refs.rms_norm(h, model.model.norm.weight, EPS), cfg.attn_res_block_size, **kw)


@pytest.mark.parametrize("layers", [26, 93], ids=["26-layers", "93-layers"])
def test_k3_forward_matches_spec_residual_path(layers, k3_26, k3_93):
    """Ours vs refs.k3_forward driving our own mixer / ffn / mix modules: the two differ only in the residual and
    carry logic, so they agree to rounding (a logic slip moves the output by O(1); see the two tests below)."""
    cfg, model = k3_26 if layers == 26 else k3_93
    ids = tokens(21)
    trace = reference_hidden(cfg, model, ids)
    assert_close(ours_hidden(cfg, model, ids), trace.hidden, 1e-6, f"K3 {layers}-layer hidden")
    expected_boundaries = [b for b in BOUNDARIES_93 if b < layers]
    assert trace.boundaries == expected_boundaries
    assert trace.carry_len == len(expected_boundaries)
    assert trace.output_sources == len(expected_boundaries) + 1


def test_k3_forward_matches_fully_independent_reference():
    """14 layers (blocks open at 0 and 12; MLA at 3, 7, 11, 13) with every mixer, ffn and mix also from refs.py
    (KDA token loop, MLA, latent MoE, AttnRes).

    Random deep models amplify fp32 rounding (single layers agree to ~1e-6, this model to ~1e-4) and a rounding-level
    change can flip a near-tied top-k choice, so this model routes every token to all of its experts (routing is
    checked on its own below) and the bound is 1e-3; every logic slip tested here moves the output by > 1e-1.
    """
    cfg, model = random_model(k3_config(14, num_experts=4, num_experts_per_token=4), seed=9)
    ids = tokens(13, seed=2)
    trace = reference_hidden(cfg, model, ids, independent=True)
    assert trace.boundaries == [0, 12]
    assert_close(ours_hidden(cfg, model, ids), trace.hidden, 1e-3, "K3 14-layer hidden vs independent reference")


def test_carry_sources_seen_by_every_mix_93_layers(k3_93, monkeypatch):
    """Layer l's pre-mixer mix sees the summaries of the blocks opened before l, its pre-ffn mix also the one it
    opened itself; the output mix sees all 8 summaries plus the last hidden state (9 sources)."""
    cfg, model = k3_93
    seen: dict[str, list[int]] = {"self": [], "mlp": [], "output": []}

    def recorder(kind, original):
        def forward(cur, blocks, ops):
            seen[kind].append(blocks.shape[0])
            return original(cur, blocks, ops)
        return forward

    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attention_res, "forward", recorder("self", layer.self_attention_res.forward))
        monkeypatch.setattr(layer.mlp_res, "forward", recorder("mlp", layer.mlp_res.forward))
    out = model.model.output_attn_res
    monkeypatch.setattr(out, "forward", recorder("output", out.forward))
    ours_hidden(cfg, model, tokens(9))
    # Layer 0 has an empty carry and skips the pre-mixer mix.
    assert seen["self"] == [sum(b < layer for b in BOUNDARIES_93) for layer in range(1, 93)]
    assert seen["mlp"] == [sum(b <= layer for b in BOUNDARIES_93) for layer in range(93)]
    assert seen["output"] == [8], "the output mix must see 8 summaries + the current value = 9 sources"


def test_output_mix_comes_before_final_norm(k3_26):
    cfg, model = k3_26
    ids = tokens(17, seed=5)
    ours = ours_hidden(cfg, model, ids)
    mix_then_norm = reference_hidden(cfg, model, ids).hidden
    norm_then_mix = reference_hidden(cfg, model, ids, mix_before_norm=False).hidden
    assert rel_err(norm_then_mix, mix_then_norm) > 1e-2, "the two orders must be distinguishable on this model"
    assert_close(ours, mix_then_norm, 1e-6, "ours vs mix-then-norm")
    assert rel_err(ours, norm_then_mix) > 1e-2, "ours matches the norm-then-mix order"


def test_dropped_carry_changes_output(k3_26):
    cfg, model = k3_26
    ids = tokens(17, seed=6)
    ours = ours_hidden(cfg, model, ids)
    with_carry = reference_hidden(cfg, model, ids).hidden
    without_carry = reference_hidden(cfg, model, ids, keep_carry=False).hidden
    assert rel_err(without_carry, with_carry) > 1e-2, "dropping the carry must be visible on this model"
    assert_close(ours, with_carry, 1e-6, "ours vs the carry reference")
    assert rel_err(ours, without_carry) > 1e-2, "ours matches the dropped-carry reference"


# -- SiTU-GLU ------------------------------------------------------------------------------------------------------
def test_situ_glu_hand_values():
    # gate 0 -> 0; gate, up large -> b * 1 * 1 * bl = 100; gate=ln3 (sigmoid 3/4), up tiny (tanh(u/bl)*bl ~ u).
    gate = torch.tensor([0.0, 100.0, math.log(3.0)])
    up = torch.tensor([5.0, 1000.0, 1e-3])
    expected = torch.tensor([0.0, 100.0, 4 * math.tanh(math.log(3.0) / 4) * 0.75 * 25 * math.tanh(1e-3 / 25)])
    torch.testing.assert_close(glu(gate, up, "situ", (4.0, 25.0)), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_situ_glu_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(64, 24, generator=gen) * 20).to(dtype), (torch.randn(64, 24, generator=gen) * 60).to(dtype)
    out = glu(gate, up, "situ", (4.0, 25.0))
    assert out.dtype == dtype
    assert torch.equal(out, refs.situ_glu(gate, up, 4.0, 25.0)), "SiTU-GLU must be computed in fp32, then cast"
    assert_close(glu(gate.float(), up.float(), "silu", (4.0, 25.0)), refs.swiglu(gate.float(), up.float()), 1e-6)


def test_dense_mlp_uses_situ(k3_26):
    cfg, model = k3_26
    mlp = model.model.layers[0].mlp
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = refs.gated_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, act_of(cfg))
    assert_close(mlp(x, one_sequence_ctx(cfg, 7)), expected, 1e-6, "dense SiTU MLP")


# -- KDA gates -----------------------------------------------------------------------------------------------------
def gate_inputs(seed=0, h=3, k=8, t=50, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    f = torch.randn(t, h, k, generator=gen) * scale
    a_log = torch.log(torch.rand(h, generator=gen) * 15 + 1)
    dt_bias = torch.randn(h * k, generator=gen)
    return f, a_log, dt_bias


def test_lower_bound_gate_formula_and_range():
    f, a_log, dt_bias = gate_inputs()
    g = kda_gate(f, a_log, dt_bias, -5.0)
    assert_close(g, refs.kda_gate(f, a_log, dt_bias, -5.0), 1e-6, "lower-bound gate")
    assert g.dtype == torch.float32
    assert float(g.min()) < -4.9 and float(g.max()) > -0.1, "inputs must reach both ends of the range"
    assert bool((g >= -5.0).all()) and bool((g <= 0).all()), f"g outside [-5, 0]: {g.min()}, {g.max()}"
    # Strictly below 0 wherever fp32 can represent sigmoid(exp(A_log) * (f + dt_bias)) (argument above -87).
    arg = torch.exp(a_log).view(1, -1, 1) * (f + dt_bias.view(3, 8))
    assert bool((g[arg > -87] < 0).all()), "a log-decay of exactly 0 where the sigmoid is representable"
    # Saturation: never below the bound, never a positive (growing) log-decay.
    extreme = kda_gate(torch.full((2, 3, 8), 1e4) * torch.tensor([1.0, -1.0])[:, None, None], a_log, dt_bias, -5.0)
    assert bool((extreme >= -5.0).all()) and bool((extreme <= 0).all())
    assert torch.allclose(extreme[0], torch.full_like(extreme[0], -5.0))
    # Hand value: A_log = 0, f + dt_bias = ln3 -> -5 * sigmoid(ln3) = -3.75.
    one = kda_gate(torch.full((1, 1, 1), math.log(3.0)), torch.zeros(1), torch.zeros(1), -5.0)
    assert math.isclose(float(one), -3.75, rel_tol=1e-6)


def test_softplus_gate_formula_including_linear_region():
    f, a_log, dt_bias = gate_inputs(seed=1, scale=15.0)  # many entries above the softplus threshold of 20
    assert bool((f + dt_bias.view(3, 8) > 20).any())
    g = kda_gate(f, a_log, dt_bias, None)
    assert_close(g, refs.kda_gate(f, a_log, dt_bias, None), 1e-6, "softplus gate")
    assert bool((g <= 0).all())


# -- mixers against the spec ----------------------------------------------------------------------------------------
MIXER_CASES = {
    "k3-kda-lower-bound-full-rank-gate": (k3_config(8), 0),
    "linear-kda-softplus-low-rank-gate": (linear_config(), 1),
    "k3-mla-q-lora-output-gate": (k3_config(8), 3),
    "linear-mla-plain": (linear_config(), 3),
}


@pytest.mark.parametrize("case", MIXER_CASES)
def test_mixer_matches_reference(case):
    raw, layer_idx = MIXER_CASES[case]
    cfg, model = random_model(raw, seed=7)
    attn = model.model.layers[layer_idx].self_attn
    x = torch.randn(23, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = attn(x, one_sequence_ctx(cfg, 23))
    if cfg.layer_kinds[layer_idx] == "kda":
        k = cfg.kda
        w = kda_weights(attn)
        assert (w.g_full is not None) == ("k3" in case) and (w.g_a is None) == ("k3" in case)
        expected = refs.kda_layer(x, w, k.num_heads, k.head_dim, k.gate_lower_bound, EPS)
        constant_gate = {"g_full": torch.zeros_like(w.q), "g_a": None, "g_b": None}  # sigmoid(0) everywhere
        ungated = refs.kda_layer(x, refs.KDAWeights(**{**w.__dict__, **constant_gate}), k.num_heads, k.head_dim,
                                 k.gate_lower_bound, EPS)
    else:
        m = cfg.mla
        w = mla_weights(attn)
        assert (w.q_a is not None and w.g is not None) == ("k3" in case)
        expected = refs.mla_layer(x, w, m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                                  MLA_LATENT_EPS)
        ungated = refs.mla_layer(x, refs.MLAWeights(**{**w.__dict__, "g": None}), m.num_heads, m.qk_nope_head_dim,
                                 m.qk_rope_head_dim, m.v_head_dim, MLA_LATENT_EPS)
    assert_close(ours, expected, 1e-5, case)
    if case != "linear-mla-plain":
        assert rel_err(ungated, expected) > 1e-2, "the output gate must matter on this layer"


@pytest.mark.parametrize("case", ["k3-mla-q-lora-output-gate", "linear-mla-plain"])
def test_mla_latent_norms_use_eps_1e_6(case):
    """q_a_layernorm / kv_a_layernorm normalise with eps 1e-6 (the model authors' code and transformers), not
    rms_norm_eps. Latents scaled down to a mean square near 1e-6 make the two choices far apart."""
    raw, layer_idx = MIXER_CASES[case]
    cfg, model = random_model(raw, seed=7)
    attn = model.model.layers[layer_idx].self_attn
    for name in ("q_a_proj", "kv_a_proj_with_mqa"):
        if hasattr(attn, name):
            getattr(attn, name).weight.data *= 1e-3
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = attn(x, one_sequence_ctx(cfg, 11))
    m, w = cfg.mla, mla_weights(attn)
    run = lambda eps: refs.mla_layer(x, w, m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim,  # noqa: E731
                                     m.v_head_dim, eps)
    assert rel_err(run(cfg.rms_norm_eps), run(MLA_LATENT_EPS)) > 1e-2
    assert_close(ours, run(MLA_LATENT_EPS), 1e-5, case)


# -- MoE -------------------------------------------------------------------------------------------------------------
def test_routing_hand_computed():
    """E=4, top-2, identity gate so logits = x = [2, 1, 0, -1]; bias [0, 0, 0, 1] picks experts 3 and 0
    (biased 1.27 and 0.88), weighted by the unbiased sigmoid scores renormalised, times 2.5."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = moe_route(x, torch.eye(4), torch.tensor([0.0, 0.0, 0.0, 1.0]), 2, True, 2.5)
    s0, s3 = refs.sigmoid(2.0), refs.sigmoid(-1.0)
    got = dict(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
    assert set(got) == {0, 3}
    assert math.isclose(got[0], 2.5 * s0 / (s0 + s3), rel_tol=1e-6)
    assert math.isclose(got[3], 2.5 * s3 / (s0 + s3), rel_tol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "raw"])
def test_routing_matches_reference(renormalize):
    gen = torch.Generator().manual_seed(2)
    t, d, e, k = 40, 16, 12, 4
    x, gate_w = torch.randn(t, d, generator=gen), torch.randn(e, d, generator=gen) / 4
    bias = torch.randn(e, generator=gen) * 0.3
    weights, ids = moe_route(x, gate_w, bias, k, renormalize, 2.446)
    expected = refs.route(x, gate_w, bias, k, renormalize, 2.446)
    unbiased = refs.route(x, gate_w, torch.zeros(e), k, renormalize, 2.446)
    assert any({i for i, _ in a} != {i for i, _ in b} for a, b in zip(expected, unbiased)), \
        "the bias must change some selections here, or this test cannot see it"
    for row, (w_row, id_row) in enumerate(zip(weights.tolist(), ids.tolist(), strict=True)):
        got = dict(zip(id_row, w_row, strict=True))
        want = dict(expected[row])
        assert set(got) == set(want), f"token {row}: experts {sorted(got)} != {sorted(want)}"
        for expert, weight in want.items():
            assert math.isclose(got[expert], weight, rel_tol=1e-5), f"token {row} expert {expert}"


@pytest.mark.parametrize("case", ["k3-latent-situ", "linear-plain-swiglu"])
def test_moe_block_matches_reference(case):
    raw = k3_config(4, num_experts=8, num_experts_per_token=3) if case.startswith("k3") else linear_config()
    cfg, model = random_model(raw, seed=8)
    block = model.model.layers[2].block_sparse_moe
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ours = block(x, one_sequence_ctx(cfg, 30))
    w = moe_weights(block)
    assert (w.latent_down is not None and w.latent_norm is not None) == case.startswith("k3")
    m = cfg.moe
    expected = refs.moe(x, w, m.top_k, m.renormalize, m.routed_scaling_factor, act_of(cfg), EPS)
    assert_close(ours, expected, 1e-5, case)
    if case.startswith("k3"):
        no_norm = refs.moe(x, refs.MoEWeights(**{**w.__dict__, "latent_norm": None}), m.top_k, m.renormalize,
                           m.routed_scaling_factor, act_of(cfg), EPS)
        assert rel_err(no_norm, expected) > 1e-2, "the latent norm must matter here"


# -- KDA chunked prefill vs the token loop ----------------------------------------------------------------------------
KDA_CASES = {
    "softplus-200": (None, [200]),
    "lower-bound-200": (-5.0, [200]),
    "softplus-varlen": (None, [1, 63, 65, 130, 7]),
    "lower-bound-varlen": (-5.0, [129, 1, 64, 71]),
}


@pytest.mark.parametrize("case", KDA_CASES)
def test_kda_chunked_prefill_matches_naive(case):
    lower_bound, lengths = KDA_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    h, k, total = 2, 16, sum(lengths)
    q, kk, v = (torch.randn(total, h, k, generator=gen) for _ in range(3))
    f = torch.randn(total, h, k, generator=gen) * 2
    beta_logits = torch.randn(total, h, generator=gen)
    a_log = torch.log(torch.rand(h, generator=gen) * 15 + 1)
    dt_bias = torch.randn(h * k, generator=gen)
    g = refs.kda_gate(f, a_log, dt_bias, lower_bound)
    if lower_bound is not None:
        assert float(g.min()) < -4.5, "the -5 bound must be approached for the test to stress it"
    slots = torch.arange(1, len(lengths) + 1).flip(0)  # slot 0 is never used: poisoned
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    pool = torch.randn(len(lengths) + 1, h, k, k, generator=gen) * 0.5
    pool[0] = float("nan")
    ref_pool = pool.clone()
    out = kda_prefill(q, kk, v, f, beta_logits, a_log, dt_bias, lower_bound, pool, slots, cu)
    expected = naive_kda_varlen(q, kk, v, f, beta_logits, a_log, dt_bias, lower_bound, ref_pool, slots, cu)
    # Chunked vs token order of fp32 sums over up to 200 steps: agreement to ~1e-5 of the largest value.
    assert_close(out, expected, 1e-4, f"{case} outputs")
    assert_close(pool[1:], ref_pool[1:], 1e-4, f"{case} final states")
    assert bool(pool[0].isnan().all()), "an unused slot was written"
