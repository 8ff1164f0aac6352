"""make-tiny -> load_model round trips: every parameter equals what was written, derived here by hand from the
files (independent of the loader's own name table)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from shard_svc.checkpoint import expected_tensors, load_model
from shard_svc.checkpoint.files import CheckpointFiles
from shard_svc.config import ModelConfig
from shard_svc.forward_batch import ForwardBatch, ForwardContext
from shard_svc.make_tiny import write_tiny_checkpoint
from shard_svc.ops import select_ops
from shard_svc.state.pools import KDAStatePool, MLAKVCache
from tests.fresh_process import run_python
from tests.model.conftest import copy_checkpoint, edit_file

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_ATTN_RES = re.compile(r"(self_attention_res|mlp_res|output_attn_res)_(norm|proj)\.weight$")


def ref_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """docs/models.md#mxfp4-experts again in float64: low nibble first, bit 3 sign, scale byte = exponent."""
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    p = packed.long()
    codes = torch.stack([p % 16, p // 16], dim=-1).flatten(-2)  # [out, in]
    values = magnitudes[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    exponent = (scale.double() - 127.0).repeat_interleave(32, dim=-1)
    return values * torch.pow(2.0, exponent)


def expected_params(ckpt: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Model parameter name -> value, from the stored tensors and the rules of docs/models.md#stored-vs-model-layout."""
    stored: dict[str, torch.Tensor] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        stored.update(load_file(path))
    params: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in stored.items():
        name = _ATTN_RES.sub(r"\1.\2.weight", name.removeprefix(cfg.tensor_prefix))
        name = re.sub(r"\.block_sparse_moe\.((gate|up|down)_proj\.weight)$", r".mlp.\1", name)
        if m := _EXPERT.match(name):
            experts.setdefault((m[1], m[3]), {}).setdefault(int(m[2]), {})[m[4]] = t
        elif name.endswith("A_log"):
            params[name] = t.flatten()[: cfg.kda.num_heads]
        else:
            params[name] = t
    for (head, which), per_expert in experts.items():
        slices = [per_expert[e] for e in range(len(per_expert))]
        params[f"{head}.{which}"] = torch.stack([
            s["weight"] if "weight" in s else ref_dequant(s["weight_packed"], s["weight_scale"]) for s in slices])
    return params


def assert_loaded_as_written(ckpt: Path, model, cfg: ModelConfig) -> None:
    want = expected_params(ckpt, cfg)
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.device.type == "cpu" and not p.requires_grad, name
        assert p.shape == want[name].shape, name
        assert torch.equal(p, want[name].to(p.dtype)), name


def test_kimi_linear_round_trip(tiny_linear):
    cfg, model = load_model(tiny_linear)
    assert cfg.model_type == "kimi_linear" and cfg.layer_kinds == ("kda", "kda", "kda", "mla")
    assert (tiny_linear / "model.safetensors").is_file() and not (tiny_linear / "model.safetensors.index.json").exists()
    assert model.model.layers[1].block_sparse_moe.experts.w1.dtype == torch.bfloat16
    assert_loaded_as_written(tiny_linear, model, cfg)


@pytest.mark.slow  # the 93-layer checkpoint: out of `make test-fast`
def test_kimi_k3_round_trip_93_layers_sharded_mxfp4(tiny_k3):
    index = json.loads((tiny_k3 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4
    cfg, model = load_model(tiny_k3)
    assert cfg.num_layers == 93 and cfg.quantization == "mxfp4" and cfg.layer_map.num_mla == 24
    assert [i for i, k in enumerate(cfg.layer_kinds) if k == "mla"] == list(range(3, 92, 4)) + [92]
    assert_loaded_as_written(tiny_k3, model, cfg)
    a_log = model.model.layers[0].self_attn.A_log
    assert a_log.shape == (cfg.kda.num_heads,) and a_log.dtype == torch.float32
    assert all(layer.self_attention_res.proj.weight.abs().sum() > 0 for layer in model.model.layers)


def test_load_as_float32_converts_every_weight(tiny_k3_small):
    cfg, model = load_model(tiny_k3_small, dtype="float32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_loaded_as_written(tiny_k3_small, model, cfg)


def test_dense_layer_stored_under_block_sparse_moe_is_accepted(tiny_linear, tmp_path):
    ckpt = copy_checkpoint(tiny_linear, tmp_path / "ckpt")

    def rename(t):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            t[f"model.layers.0.block_sparse_moe.{proj}.weight"] = t.pop(f"model.layers.0.mlp.{proj}.weight")

    edit_file(ckpt / "model.safetensors", rename)
    cfg, model = load_model(ckpt)
    assert_loaded_as_written(ckpt, model, cfg)


def test_every_stored_tensor_is_read_exactly_once(tiny_k3_small, monkeypatch):
    reads: Counter[str] = Counter()
    original = CheckpointFiles.read
    monkeypatch.setattr(CheckpointFiles, "read", lambda self, name: reads.update([name]) or original(self, name))
    load_model(tiny_k3_small)
    names = json.loads((tiny_k3_small / "model.safetensors.index.json").read_text())["weight_map"]
    assert reads == Counter(names.keys())


def test_expected_tensors_matches_the_files_written(tiny_k3_small):
    cfg = ModelConfig.from_dir(tiny_k3_small)
    specs = expected_tensors(cfg)
    names = json.loads((tiny_k3_small / "model.safetensors.index.json").read_text())["weight_map"]
    assert specs.keys() == names.keys()
    packed = specs["language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight_packed"]
    assert packed.shape == (64, 16) and packed.dtypes == (torch.uint8,) and packed.expert == 7
    assert specs["language_model.model.layers.0.self_attn.A_log"].shape == (cfg.kda.head_dim,)


def test_make_tiny_is_deterministic_and_refuses_a_used_directory(tmp_path):
    a = write_tiny_checkpoint("kimi_linear", tmp_path / "a", seed=7, layers=2)
    b = tmp_path / "b"  # written by another process with another hash seed
    run_python(f"from pathlib import Path; from shard_svc.make_tiny import write_tiny_checkpoint; "
               f"write_tiny_checkpoint('kimi_linear', Path({str(b)!r}), seed=7, layers=2)")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        write_tiny_checkpoint("kimi_linear", a, seed=7, layers=2)


def test_make_tiny_writes_the_tokenizer(tmp_path):
    from shard_svc.make_tiny import make_tiny

    out = make_tiny("kimi_linear", tmp_path / "t", layers=1)
    cfg, tok = ModelConfig.from_dir(out), Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.token_to_id("[BOS]") == cfg.bos_token_id == 512 and tok.token_to_id("[PAD]") == cfg.pad_token_id
    assert tok.token_to_id("<|im_end|>") == cfg.eos_token_ids[0] == 514
    assert tok.get_vocab_size() <= cfg.vocab_size and max(tok.encode("hello world").ids) < cfg.vocab_size


def prefill_logits(cfg: ModelConfig, model, ids: torch.Tensor) -> torch.Tensor:
    """One sequence through the eager path with fresh (zeroed) pools: state slot 0, KV block 0. [T, vocab] fp32."""
    cpu, t = torch.device("cpu"), len(ids)
    dtype = model.model.embed_tokens.weight.dtype
    pool, cache = KDAStatePool(cfg, 1, cpu, dtype), MLAKVCache(cfg, 1, t, cpu, dtype)
    batch = ForwardBatch(cu_seqlens=torch.tensor([0, t]), ctx_lens=torch.tensor([0]), state_slots=torch.tensor([0]),
                         block_tables=torch.tensor([[0]], dtype=torch.int32), slot_mapping=torch.arange(t),
                         is_decode=False)
    ops = select_ops(cpu, "eager")
    hidden = model(ids, ForwardContext(batch, pool, cache, ops))
    return model.compute_logits(hidden, ops)


@pytest.mark.parametrize("family", ["tiny_linear", pytest.param("tiny_k3", marks=pytest.mark.slow)])
def test_tiny_forward_is_sane(family, request):
    cfg, model = load_model(request.getfixturevalue(family), dtype="float32")
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = prefill_logits(cfg, model, ids)
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std() < 100
    assert len(set(logits.argmax(-1).tolist())) > 3  # different tokens come out at different positions
