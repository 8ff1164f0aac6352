"""Typed, range-checked reads of config.json values, so a bad value is refused before anything is allocated.

A size that is a float (`"num_experts": 1e7` parses as 10000000.0), a bool, a string, or outside a sane range would
otherwise reach the model's constructors, which allocate (gigabytes for ten million experts) before anything fails.
Every refusal is a `ConfigValueError` naming the key, the value, the allowed range and the config.json path.

The upper bounds are generous multiples of the largest published Kimi model (Kimi-K3: hidden 7,168, 93 layers,
96 heads, 896 experts, vocab 163,840, context 1,048,576), there to catch typos and hostile files, not to limit
real checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shard_svc.errors import ConfigValueError

_REQUIRED = object()

# key -> (lowest, highest) allowed value; the comment gives the Kimi-K3 value.
SIZE_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),  # 163,840
    "hidden_size": (1, 1 << 16),  # 7,168
    "num_hidden_layers": (1, 1024),  # 93
    "num_attention_heads": (1, 1024),  # 96 (MLA; KDA's default)
    "num_heads": (1, 1024),  # 96 (KDA)
    "head_dim": (1, 1024),  # 128 (KDA)
    "short_conv_kernel_size": (1, 64),  # 4
    "q_lora_rank": (1, 1 << 16),  # 1,536
    "kv_lora_rank": (1, 1 << 16),  # 512
    "qk_nope_head_dim": (1, 1024),  # 128
    "qk_rope_head_dim": (0, 1024),  # 64
    "v_head_dim": (1, 1024),  # 128
    "intermediate_size": (0, 1 << 20),  # 33,792 (dense layers; 0 when there are none)
    "moe_intermediate_size": (0, 1 << 18),  # 3,072 (0 when there are no MoE layers)
    "num_experts": (0, 1 << 14),  # 896
    "num_experts_per_token": (0, 1024),  # 16
    "num_shared_experts": (0, 64),  # 2
    "routed_expert_hidden_size": (1, 1 << 16),  # 3,584 (latent MoE)
    "attn_res_block_size": (1, 1024),  # 12
    "first_k_dense_replace": (0, 1024),  # 1 (also at most num_hidden_layers)
    "max_position_embeddings": (1, 1 << 26),  # 1,048,576
    "num_expert_group": (1, 1 << 14),
    "topk_group": (1, 1 << 14),
}
# The keys a value may be spelled as (HF / DeepSeek names), in the order they are looked up.
SPELLINGS = {
    "num_experts": ("num_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "max_position_embeddings": ("model_max_length", "max_position_embeddings"),
}


class ConfigReader:
    """Reads keys from config.json sections in order (e.g. linear_attn_config, then text_config)."""

    def __init__(self, source: str, *sections: Mapping[str, Any]):
        self.source, self.sections = source, sections

    def _find(self, keys: tuple[str, ...]) -> tuple[str, Any]:
        for key in keys:
            for section in self.sections:
                if key in section:
                    return key, section[key]
        return keys[0], _REQUIRED

    def _fail(self, key: str, value: Any, wanted: str) -> ConfigValueError:
        return ConfigValueError(f"{self.source}: {key} = {value!r} ({_kind(value)}) is not {wanted}")

    def size(self, key: str, default: Any = _REQUIRED, hi: int | None = None) -> int:
        """An integer in SIZE_RANGES[key] (`hi` may lower the top, e.g. to another field's value)."""
        found, value = self._find(SPELLINGS.get(key, (key,)))
        if value is _REQUIRED:
            if default is _REQUIRED:
                raise ConfigValueError(f"{self.source}: required key {key!r} is missing")
            return default
        lo, top = SIZE_RANGES[key]
        return self.check_int(found, value, lo, top if hi is None else min(top, hi))

    def optional_size(self, key: str) -> int | None:
        """As `size`, but absent or null is None (the feature is off)."""
        found, value = self._find(SPELLINGS.get(key, (key,)))
        return None if value is _REQUIRED or value is None else self.check_int(found, value, *SIZE_RANGES[key])

    def check_int(self, key: str, value: Any, lo: int, hi: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(key, value, f"an integer in [{lo}, {_fmt(hi)}]")
        if not lo <= value <= hi:
            raise self._fail(key, value, f"in the allowed range [{lo}, {_fmt(hi)}]")
        return value

    def real(self, key: str, default: float | None, lo: float, hi: float) -> float | None:
        """A finite number in [lo, hi]; ints are fine here (`1` for 1.0). Absent: `default`."""
        found, value = self._find((key,))
        if value is _REQUIRED or (value is None and default is None):
            return default
        if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
                or not lo <= value <= hi):
            raise self._fail(found, value, f"a finite number in [{lo}, {hi}]")
        return float(value)

    def token_id(self, key: str, vocab_size: int) -> int | None:
        """An id in [0, vocab_size), or None when absent or null."""
        found, value = self._find((key,))
        return None if value is _REQUIRED or value is None else self.check_int(found, value, 0, vocab_size - 1)

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        """An id or a list of ids (eos_token_id may be either), each in [0, vocab_size)."""
        found, value = self._find((key,))
        if value is _REQUIRED or value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        return tuple(self.check_int(found, v, 0, vocab_size - 1) for v in values)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _fmt(value: int) -> str:
    return f"{value:,}"
