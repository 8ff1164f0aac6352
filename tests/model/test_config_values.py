"""config.json values are typed and range-checked before anything is allocated: a float where a size is expected
(`1e7` parses as 10000000.0), a bool, a string or an absurd size is a ConfigValueError naming the key, the value,
the allowed range and the file."""

from __future__ import annotations

import json

import pytest
import torch

from bench.configs import KIMI_LINEAR_48B
from bench.streaming import k3_slice_config
from shard_svc.checkpoint import load_model
from shard_svc.config import ModelConfig
from shard_svc.errors import ConfigError, ConfigValueError
from tests.model.conftest import copy_checkpoint
from tests.model.test_loader_errors import edit_config


@pytest.fixture
def linear(tiny_linear, tmp_path):
    return copy_checkpoint(tiny_linear, tmp_path / "ckpt")


@pytest.fixture
def k3(tiny_k3_small, tmp_path):
    return copy_checkpoint(tiny_k3_small, tmp_path / "ckpt")


def test_real_model_configs_are_accepted():
    """The bounds are for typos and hostile files: the published full-size configs pass them."""
    linear = ModelConfig.from_dict(KIMI_LINEAR_48B)
    assert (linear.moe.num_experts, linear.vocab_size, linear.max_position_embeddings) == (256, 163840, 1 << 20)
    k3 = ModelConfig.from_dict(k3_slice_config(93))
    assert (k3.moe.num_experts, k3.hidden_size, k3.num_layers) == (896, 7168, 93)


def test_float_num_experts_is_refused_before_allocation(linear, monkeypatch):
    """`num_experts: 1e7` used to build ten million expert modules (gigabytes) before anything failed: now the config
    is refused before a single module is built (counted at torch.nn.Module.__init__, not by the clock)."""
    edit_config(linear, lambda raw: raw.update(num_experts=1e7))
    built = []
    module_init = torch.nn.Module.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        module_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__init__", counting_init)
    with pytest.raises(ConfigValueError) as e:
        load_model(linear)
    assert built == [], f"modules built before the refusal: {built[:5]} ({len(built)} in all)"
    message = str(e.value)
    assert f"{linear / 'config.json'}: num_experts = 10000000.0 (float) is not an integer in [0, 16,384]" == message


@pytest.mark.parametrize("key, value, fragment", [
    ("num_experts", 10_000_000, "num_experts = 10000000 (int) is not in the allowed range [0, 16,384]"),
    ("num_experts", "8", "num_experts = '8' (str) is not an integer in [0, 16,384]"),
    ("num_experts", True, "num_experts = True (bool) is not an integer"),
    ("hidden_size", 64.0, "hidden_size = 64.0 (float) is not an integer in [1, 65,536]"),
    ("hidden_size", 0, "hidden_size = 0 (int) is not in the allowed range [1, 65,536]"),
    ("hidden_size", None, "hidden_size = None (null) is not an integer"),
    ("vocab_size", -5, "vocab_size = -5 (int) is not in the allowed range [1, 4,194,304]"),
    ("num_hidden_layers", 1e9, "num_hidden_layers = 1000000000.0 (float) is not an integer in [1, 1,024]"),
    ("num_attention_heads", 5000, "num_attention_heads = 5000 (int) is not in the allowed range [1, 1,024]"),
    ("kv_lora_rank", [512], "kv_lora_rank = [512] (list) is not an integer"),
    ("qk_rope_head_dim", 1 << 20, "qk_rope_head_dim = 1048576 (int) is not in the allowed range [0, 1,024]"),
    ("intermediate_size", 1e12, "intermediate_size = 1000000000000.0 (float) is not an integer in [0, 1,048,576]"),
    ("moe_intermediate_size", -1, "moe_intermediate_size = -1 (int) is not in the allowed range [0, 262,144]"),
    ("num_experts_per_token", 9, "MoE layers need 0 < num_experts_per_token (9) <= num_experts (8)"),
    ("num_shared_experts", 1000, "num_shared_experts = 1000 (int) is not in the allowed range [0, 64]"),
    ("first_k_dense_replace", 5, "first_k_dense_replace = 5 (int) is not in the allowed range [0, 4]"),
    ("model_max_length", 1 << 40, "model_max_length = 1099511627776 (int) is not in the allowed range"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps = nan (float) is not a finite number in [1e-12, 0.1]"),
    ("rms_norm_eps", -1.0, "rms_norm_eps = -1.0 (float) is not a finite number"),
    ("routed_scaling_factor", "2", "routed_scaling_factor = '2' (str) is not a finite number"),
    ("eos_token_id", 1 << 30, "eos_token_id = 1073741824 (int) is not in the allowed range [0, "),
    ("eos_token_id", [5, 2.5], "eos_token_id = 2.5 (float) is not an integer"),
    ("bos_token_id", -1, "bos_token_id = -1 (int) is not in the allowed range [0, "),
])
def test_kimi_linear_values_are_typed_and_range_checked(linear, key, value, fragment):
    edit_config(linear, lambda raw: raw.update({key: value}))
    with pytest.raises(ConfigValueError) as e:
        ModelConfig.from_dir(linear)
    assert fragment in str(e.value) and str(linear / "config.json") in str(e.value)


@pytest.mark.parametrize("edit, fragment", [
    (lambda lin: lin.update(num_heads=2.0), "num_heads = 2.0 (float) is not an integer in [1, 1,024]"),
    (lambda lin: lin.update(head_dim=100_000), "head_dim = 100000 (int) is not in the allowed range [1, 1,024]"),
    (lambda lin: lin.update(short_conv_kernel_size=0), "short_conv_kernel_size = 0 (int) is not in the allowed"),
    (lambda lin: lin.update(full_attn_layers=[4.0]), "full_attn_layers[0] = 4.0 (float) is not an integer in [1, 4]"),
    (lambda lin: lin.update(full_attn_layers=[99]), "full_attn_layers[0] = 99 (int) is not in the allowed range"),
    (lambda lin: lin.update(kda_layers=[1, 2, "3"]), "kda_layers[2] = '3' (str) is not an integer"),
])
def test_linear_attention_values_are_checked(linear, edit, fragment):
    edit_config(linear, lambda raw: edit(raw["linear_attn_config"]))
    with pytest.raises(ConfigValueError, match="linear_attn_config|config.json") as e:
        ModelConfig.from_dir(linear)
    assert fragment in str(e.value)


@pytest.mark.parametrize("key, value, fragment", [
    ("num_experts", 1e7, "num_experts = 10000000.0 (float) is not an integer"),
    ("routed_expert_hidden_size", 0, "routed_expert_hidden_size = 0 (int) is not in the allowed range [1, 65,536]"),
    ("attn_res_block_size", 12.5, "attn_res_block_size = 12.5 (float) is not an integer"),
    ("q_lora_rank", 1 << 20, "q_lora_rank = 1048576 (int) is not in the allowed range"),
    ("activation_situ_beta", float("inf"), "activation_situ_beta = inf (float) is not a finite number"),
])
def test_k3_text_config_values_are_checked(k3, key, value, fragment):
    edit_config(k3, lambda raw: raw["text_config"].update({key: value}))
    with pytest.raises(ConfigValueError) as e:
        load_model(k3)
    assert fragment in str(e.value) and str(k3 / "config.json") in str(e.value)


def test_k3_gate_lower_bound_must_be_a_finite_non_positive_number(k3):
    edit_config(k3, lambda raw: raw["text_config"]["linear_attn_config"].update(gate_lower_bound=5.0))
    with pytest.raises(ConfigValueError, match=r"gate_lower_bound = 5.0 \(float\) is not a finite number in "
                                               r"\[-1000.0, 0.0\]"):
        ModelConfig.from_dir(k3)


@pytest.mark.parametrize("raw, fragment", [
    ([1, 2], "must be a JSON object, got list"),
    ({"model_type": "kimi_k3", "text_config": [1]}, "text_config must be a JSON object, got list"),
    ({**KIMI_LINEAR_48B, "linear_attn_config": "x"}, "linear_attn_config must be a JSON object, got str"),
    ({**KIMI_LINEAR_48B, "layer_types": [["x"]]}, "unknown layer type ['x'] in layer_types"),
])
def test_malformed_structure_is_a_config_error(raw, fragment):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw, source="/ckpt/config.json")
    assert fragment in str(e.value)


def test_dense_layers_need_an_intermediate_size(linear):
    edit_config(linear, lambda raw: raw.update(intermediate_size=0))
    with pytest.raises(ConfigValueError, match=r"dense MLP layers need intermediate_size >= 1, got 0"):
        ModelConfig.from_dir(linear)


def test_config_json_must_be_an_object(linear):
    (linear / "config.json").write_text(json.dumps([1]))
    with pytest.raises(ConfigError, match=rf"{linear / 'config.json'}: must be a JSON object"):
        ModelConfig.from_dir(linear)
