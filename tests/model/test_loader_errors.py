"""Damaged checkpoints (edited by hand with safetensors) raise named errors whose messages name tensor and file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from shard_svc.checkpoint import load_model
from shard_svc.checkpoint import loader as loader_module
from shard_svc.checkpoint.names import tensor_specs
from shard_svc.errors import (
    CheckpointFileError,
    CheckpointIndexConflict,
    CheckpointMismatch,
    NaNScaleError,
    TensorValueError,
    UnfilledParameterError,
    UnsupportedModelError,
    UnsupportedQuantizationError,
)
from tests.model.conftest import copy_checkpoint, edit_file, file_holding
from tests.model.test_loader import assert_loaded_as_written

KV_B = "model.layers.3.self_attn.kv_b_proj.weight"
Q = "model.layers.1.self_attn.q_proj.weight"
K3 = "language_model.model.layers."


@pytest.fixture
def linear(tiny_linear, tmp_path):
    return copy_checkpoint(tiny_linear, tmp_path / "ckpt")


@pytest.fixture
def k3(tiny_k3_small, tmp_path):
    return copy_checkpoint(tiny_k3_small, tmp_path / "ckpt")


def edit_config(ckpt, edit) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    edit(raw)
    (ckpt / "config.json").write_text(json.dumps(raw))


def test_missing_tensor(linear):
    edit_file(linear / "model.safetensors", lambda t: t.pop(KV_B))
    with pytest.raises(CheckpointMismatch) as e:
        load_model(linear)
    assert KV_B in str(e.value) and "model.safetensors" in str(e.value)
    assert len(e.value.problems["missing"]) == 1 and not e.value.problems["unexpected"]


def test_wrong_shape(linear):
    edit_file(linear / "model.safetensors", lambda t: t.update({Q: t[Q][:-1]}))
    with pytest.raises(CheckpointMismatch, match=rf"{Q} \(model.safetensors\): shape \[63, 64\], expected \[64, 64\]"):
        load_model(linear)


def test_wrong_dtype(linear):
    edit_file(linear / "model.safetensors", lambda t: t.update({Q: t[Q].half()}))
    with pytest.raises(CheckpointMismatch, match=rf"{Q} \(model.safetensors\): dtype float16, expected bfloat16"):
        load_model(linear)


def test_fp32_tolerated_tensors_may_be_stored_in_the_declared_dtype(linear):
    a_log = "model.layers.0.self_attn.A_log"
    edit_file(linear / "model.safetensors", lambda t: t.update({a_log: t[a_log].bfloat16()}))
    _, model = load_model(linear)
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32


def test_unexpected_tensor(linear):
    name = "model.layers.0.self_attn.bogus.weight"
    edit_file(linear / "model.safetensors", lambda t: t.update({name: torch.zeros(2)}))
    with pytest.raises(CheckpointMismatch, match=rf"unexpected \(1\):\n  {name} \(model.safetensors\)"):
        load_model(linear)


def test_all_problems_in_one_error_capped_per_kind(linear):
    def damage(t):
        for name in [n for n in t if n.startswith("model.layers.1.block_sparse_moe.experts.")]:
            del t[name]
        t[Q] = t[Q].half()

    edit_file(linear / "model.safetensors", damage)
    with pytest.raises(CheckpointMismatch) as e:
        load_model(linear)
    msg = str(e.value)
    assert len(e.value.problems["missing"]) == 24 and "... and 4 more" in msg
    assert "24 missing, 1 dtype" in msg and Q in msg


def test_dense_layer_under_both_names_is_a_conflict(linear):
    name = "model.layers.0.mlp.up_proj.weight"
    edit_file(linear / "model.safetensors",
              lambda t: t.update({name.replace(".mlp.", ".block_sparse_moe."): t[name].clone()}))
    with pytest.raises(CheckpointMismatch, match=r"conflict \(1\):\n  .*mlp.up_proj.weight \(model.safetensors\) and "
                                                 r".*block_sparse_moe.up_proj.weight \(model.safetensors\)"):
        load_model(linear)


def test_unknown_quantisation_in_config(linear):
    edit_config(linear, lambda raw: raw.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(UnsupportedQuantizationError, match=r"config.json: quantization quant_method='gptq'"):
        load_model(linear)


def test_unknown_model_type(linear):
    edit_config(linear, lambda raw: raw.update(model_type="kimi_vl"))
    with pytest.raises(UnsupportedModelError, match="kimi_vl"):
        load_model(linear)


def test_undeclared_weight_packed_is_refused(linear):
    stem = "model.layers.1.block_sparse_moe.experts.0.w1"
    edit_file(linear / "model.safetensors",
              lambda t: t.update({f"{stem}.weight_packed": torch.zeros(32, 32, dtype=torch.uint8)}))
    with pytest.raises(CheckpointMismatch, match=rf"{stem}.weight_packed \(model.safetensors\) \[a quantised-weight "
                                                 r"suffix that config.json \(quantization=None\) does not declare"):
        load_model(linear)


def test_truncated_file(linear):
    path = linear / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointFileError, match=rf"{path}: not a readable safetensors file"):
        load_model(linear)


def test_index_names_a_missing_shard(k3):
    index = json.loads((k3 / "model.safetensors.index.json").read_text())["weight_map"]
    name, shard = next((n, f) for n, f in index.items() if f.startswith("model-00002"))
    (k3 / shard).unlink()
    with pytest.raises(CheckpointFileError, match=rf"names shard files that do not exist.*{shard} \(holds \d+ tensors, "
                                                  rf"e.g. {name}\)"):
        load_model(k3)


def test_index_disagreeing_with_the_shards(k3):
    name = K3 + "0.self_attn.q_proj.weight"
    edit_file(file_holding(k3, name), lambda t: t.pop(name))
    with pytest.raises(CheckpointMismatch) as e:
        load_model(k3)
    assert any(name in line and "model-0000" in line for line in e.value.problems["index"])
    assert any(name in line for line in e.value.problems["missing"])


def test_k3_a_log_nonzero_padding_is_refused(k3):
    name = K3 + "1.self_attn.A_log"
    path = file_holding(k3, name)
    edit_file(path, lambda t: t[name].__setitem__(-1, 0.5))
    with pytest.raises(TensorValueError, match=rf"{name} \({path.name}\): A_log stored \[16\] must be zero past its "
                                               r"first 4 entries"):
        load_model(k3)


def test_k3_a_log_zero_padding_is_dropped(k3):
    name = K3 + "1.self_attn.A_log"
    _, model = load_model(k3)
    a_log = load_file(file_holding(k3, name))[name]
    assert torch.count_nonzero(a_log[4:]) == 0 and torch.count_nonzero(a_log[:4]) == 4
    assert torch.equal(model.model.layers[1].self_attn.A_log, a_log[:4])


def test_mxfp4_nan_scale_is_refused(k3):
    name = K3 + "2.block_sparse_moe.experts.5.w3.weight_scale"
    path = file_holding(k3, name)
    edit_file(path, lambda t: t[name].__setitem__((3, 1), 255))
    with pytest.raises(NaNScaleError, match=rf"{name} \({path.name}\).*255 \(NaN per the OCP MX spec\), first at "
                                            r"row 3 group 1"):
        load_model(k3)


def test_mxfp4_scale_with_wrong_dtype(k3):
    name = K3 + "2.block_sparse_moe.experts.5.w2.weight_scale"
    path = file_holding(k3, name)
    edit_file(path, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointMismatch, match=rf"{name} \({path.name}\): dtype float32, expected uint8"):
        load_model(k3)


def test_parameter_left_unfilled_is_refused(linear, monkeypatch):
    """If the table ever forgot a parameter (and the file lacked it too), the load must fail, not run on init memory."""
    def drop_one(cfg, model):
        specs = tensor_specs(cfg, model)
        specs.pop("model.norm.weight")
        return specs

    monkeypatch.setattr(loader_module, "tensor_specs", drop_one)
    edit_file(linear / "model.safetensors", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(UnfilledParameterError, match=r"model.norm.weight"):
        load_model(linear)


def test_weight_packed_outside_the_mxfp4_experts_is_refused(k3):
    name = K3 + "0.self_attn.q_proj.weight"
    path = file_holding(k3, name)
    packed = name.replace(".weight", ".weight_packed")
    edit_file(path, lambda t: t.update({packed: torch.zeros(64, 24, dtype=torch.uint8)}))
    with pytest.raises(CheckpointMismatch, match=rf"{packed} \({path.name}\) \[a quantised-weight suffix that "
                                                 r"config.json \(quantization='mxfp4'\) does not declare"):
        load_model(k3)


def test_k3_tensors_outside_the_text_model_are_skipped_and_logged(k3, caplog):
    """The multimodal wrapper's other towers are out of scope: logged, never read, never an error."""
    name = "vision_tower.patch_embed.weight"
    edit_file(k3 / "model-00001-of-00004.safetensors", lambda t: t.update({name: torch.ones(3)}))
    index_path = k3 / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name] = "model-00001-of-00004.safetensors"
    index_path.write_text(json.dumps(index))
    with caplog.at_level("INFO", logger="shard_svc.checkpoint.files"):
        load_model(k3)
    assert "skipping 1 tensors outside 'language_model.'" in caplog.text and name in caplog.text


def _write_index(ckpt, weight_map) -> None:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_single_file_with_its_own_consistent_index_loads(linear):
    """As some published checkpoints ship it (and transformers loads it): the index maps every tensor of
    model.safetensors to that file."""
    names = load_file(linear / "model.safetensors").keys()
    _write_index(linear, {name: "model.safetensors" for name in names})
    cfg, model = load_model(linear)
    assert_loaded_as_written(linear, model, cfg)


def test_single_file_and_an_index_that_disagree_name_the_differences(linear):
    stored = sorted(load_file(linear / "model.safetensors").keys())
    unindexed = stored[:7]  # more than the message lists by name
    weight_map = {name: "model.safetensors" for name in stored[7:]} | {"model.extra.weight": "model.safetensors"}
    _write_index(linear, weight_map)
    with pytest.raises(CheckpointIndexConflict) as e:
        load_model(linear)
    message = str(e.value)
    assert "holds model.safetensors and model.safetensors.index.json, which describe different weights" in message
    assert "1 tensors in model.safetensors.index.json's weight_map are not in model.safetensors (model.extra.weight)" \
        in message
    assert ("7 tensors in model.safetensors are not in model.safetensors.index.json's weight_map ("
            + ", ".join(unindexed[:5]) + ", ... 2 more)") in message
    assert unindexed[5] not in message


def test_single_file_beside_an_index_of_other_shards_is_refused(linear):
    names = sorted(load_file(linear / "model.safetensors").keys())
    shutil.copy(linear / "model.safetensors", linear / "model-00001-of-00001.safetensors")
    _write_index(linear, {name: "model-00001-of-00001.safetensors" for name in names})
    with pytest.raises(CheckpointIndexConflict, match=r"the index places tensors in 1 files "
                                                      r"\(model-00001-of-00001.safetensors\), not in "
                                                      r"model.safetensors alone: two checkpoints in one directory"):
        load_model(linear)


def test_no_weights_at_all(linear):
    (linear / "model.safetensors").unlink()
    with pytest.raises(CheckpointFileError, match="holds neither model.safetensors nor"):
        load_model(linear)
