"""The typed model config, parsed once from a checkpoint's config.json.

Both families (`kimi_linear`, `kimi_k3`) parse into one `ModelConfig`; everything downstream reads its fields,
never the raw dict. The `LayerMap` is the single source of truth for which engine layer owns which pool index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shard_svc.config_values import ConfigReader
from shard_svc.errors import ConfigError, ConfigValueError, UnsupportedModelError, UnsupportedQuantizationError

LayerKind = Literal["kda", "mla"]
MlpKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class LayerMap:
    """Engine layer index -> KDA state index or MLA cache index, derived from the config.

    Pools are laid out by these indices; nothing may assume that a dense counter matches them.
    """

    kinds: tuple[LayerKind, ...]
    kda_index: dict[int, int] = field(default_factory=dict)
    mla_index: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_kinds(cls, kinds: tuple[LayerKind, ...]) -> "LayerMap":
        kda = [i for i, k in enumerate(kinds) if k == "kda"]
        mla = [i for i, k in enumerate(kinds) if k == "mla"]
        return cls(kinds, {layer: n for n, layer in enumerate(kda)}, {layer: n for n, layer in enumerate(mla)})

    @property
    def num_kda(self) -> int:
        return len(self.kda_index)

    @property
    def num_mla(self) -> int:
        return len(self.mla_index)

    def kda_slot_of(self, layer: int) -> int:
        if layer not in self.kda_index:
            raise KeyError(f"engine layer {layer} is {self.kinds[layer]!r}, not a KDA layer")
        return self.kda_index[layer]

    def mla_slot_of(self, layer: int) -> int:
        if layer not in self.mla_index:
            raise KeyError(f"engine layer {layer} is {self.kinds[layer]!r}, not an MLA layer")
        return self.mla_index[layer]


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None  # None: softplus gate (Kimi-Linear); else K3's bounded sigmoid gate
    full_rank_output_gate: bool  # K3: g_proj [H*K, D]; Kimi-Linear: g_a_proj / g_b_proj


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool

    @property
    def latent_dim(self) -> int:
        """Width of one cached token per MLA layer: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    renormalize: bool
    latent_size: int | None  # K3 latent MoE: routed experts run at this width
    latent_norm: bool


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    intermediate_size: int  # dense MLP layers
    layer_map: LayerMap
    mlp_kinds: tuple[MlpKind, ...]
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    activation: Literal["silu", "situ"]
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    torch_dtype: str  # the checkpoint's declared float dtype: "bfloat16" | "float32" | "float16"
    quantization: Literal["mxfp4"] | None  # K3 routed experts in MXFP4
    tensor_prefix: str  # "" for kimi_linear, "language_model." for kimi_k3

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return self.layer_map.kinds

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        parser = _PARSERS.get(model_type)
        if parser is None:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported (known: {sorted(_PARSERS)})"
            )
        return parser(raw, source)


def _req(d: dict[str, Any], key: str, source: str) -> Any:
    if key not in d:
        raise ConfigError(f"{source}: required key {key!r} is missing")
    return d[key]


def _layer_kinds(text: dict[str, Any], lin: dict[str, Any], n: int, source: str,
                 reader: ConfigReader) -> tuple[LayerKind, ...]:
    if text.get("layer_types"):
        names = {"linear_attention": "kda", "full_attention": "mla"}
        types = _list(text, "layer_types", source)
        unknown = [t for t in types if not isinstance(t, str) or t not in names]
        if unknown:
            raise ConfigError(f"{source}: unknown layer type {unknown[0]!r} in layer_types")
        kinds = tuple(names[t] for t in types)
    else:
        full = [reader.check_int(f"full_attn_layers[{j}]", v, 1, n)
                for j, v in enumerate(_list(lin, "full_attn_layers", source))]
        kda = ([reader.check_int(f"kda_layers[{j}]", v, 1, n) for j, v in enumerate(_list(lin, "kda_layers", source))]
               if "kda_layers" in lin else [i for i in range(1, n + 1) if i not in full])
        kinds_list: list[str | None] = [None] * n
        for one_based, kind in [(i, "mla") for i in full] + [(i, "kda") for i in kda]:
            if kinds_list[one_based - 1] is not None:
                raise ConfigError(f"{source}: layer {one_based} (1-based) listed as both KDA and MLA")
            kinds_list[one_based - 1] = kind
        missing = [i + 1 for i, k in enumerate(kinds_list) if k is None]
        if missing:
            raise ConfigError(f"{source}: layers {missing} (1-based) are in neither kda_layers nor full_attn_layers")
        kinds = tuple(kinds_list)  # type: ignore[arg-type]
    if len(kinds) != n:
        raise ConfigError(f"{source}: {len(kinds)} layer types for num_hidden_layers={n}")
    return kinds  # type: ignore[return-value]


def _list(d: dict[str, Any], key: str, source: str) -> list[Any]:
    value = _req(d, key, source)
    if not isinstance(value, list):
        raise ConfigError(f"{source}: {key} must be a list, got {type(value).__name__}")
    return value


def _mlp_kinds(text: dict[str, Any], n: int, source: str, reader: ConfigReader) -> tuple[MlpKind, ...]:
    if text.get("mlp_layer_types"):
        names = {"dense": "dense", "sparse": "moe"}
        kinds = tuple(names.get(t) if isinstance(t, str) else None for t in _list(text, "mlp_layer_types", source))
        if None in kinds or len(kinds) != n:
            raise ConfigError(f"{source}: mlp_layer_types must be {n} of 'dense'|'sparse'")
        return kinds  # type: ignore[return-value]
    if text.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(f"{source}: moe_layer_freq={text['moe_layer_freq']} is not supported")
    first_dense = reader.size("first_k_dense_replace", 0, hi=n)
    return tuple("dense" if i < first_dense else "moe" for i in range(n))


def _quantization(text: dict[str, Any], source: str) -> Literal["mxfp4"] | None:
    q = text.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    formats = {q.get("format")} | {g.get("format") for g in q.get("config_groups", {}).values()}
    formats.discard(None)
    if method == "compressed-tensors" and formats == {"mxfp4-pack-quantized"}:
        for name, group in q.get("config_groups", {}).items():
            w = group.get("weights") or {}
            if w.get("group_size", 32) != 32 or w.get("num_bits", 4) != 4:
                raise UnsupportedQuantizationError(
                    f"{source}: MXFP4 group {name!r} has group_size={w.get('group_size')} "
                    f"num_bits={w.get('num_bits')}; only 4-bit groups of 32 are understood"
                )
        return "mxfp4"
    raise UnsupportedQuantizationError(
        f"{source}: quantization quant_method={method!r} format={sorted(formats)} is not supported "
        "(known: compressed-tensors mxfp4-pack-quantized)"
    )


def _section(d: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = d.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key} must be a JSON object, got {type(value).__name__}")
    return value


def _parse(raw: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """Every size is read through ConfigReader (typed and range-checked, config_values.py) before anything is built
    from it; consistency between fields is checked here."""
    text = (_section(raw, "text_config", source) or raw) if model_type == "kimi_k3" else raw
    lin = _section(text, "linear_attn_config", source)
    t = ConfigReader(source, text)
    la = ConfigReader(source, lin, text)  # KDA keys: linear_attn_config first, then the text config
    n = t.size("num_hidden_layers")
    if text.get("use_grouped_topk") and t.size("num_expert_group", 1) > 1 and (
        t.size("topk_group", 1) < t.size("num_expert_group", 1)
    ):
        raise UnsupportedModelError(
            f"{source}: grouped top-k routing (num_expert_group={text['num_expert_group']}, "
            f"topk_group={text.get('topk_group')}) is not supported; only plain top-k"
        )
    if text.get("mla_use_nope") is False:
        raise UnsupportedModelError(f"{source}: mla_use_nope=false (rotary MLA) is not supported")
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "situ"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu, situ)")
    mla_heads = t.size("num_attention_heads")
    kda = KDAConfig(
        num_heads=la.size("num_heads", mla_heads),
        head_dim=la.size("head_dim", 128),
        conv_kernel=la.size("short_conv_kernel_size", 4),
        gate_lower_bound=la.real("gate_lower_bound", None, -1e3, 0.0),
        full_rank_output_gate=bool(lin.get("use_full_rank_gate", text.get("use_full_rank_gate", False))),
    )
    mla = MLAConfig(
        num_heads=mla_heads,
        q_lora_rank=t.optional_size("q_lora_rank"),
        kv_lora_rank=t.size("kv_lora_rank"),
        qk_nope_head_dim=t.size("qk_nope_head_dim"),
        qk_rope_head_dim=t.size("qk_rope_head_dim"),
        v_head_dim=t.size("v_head_dim"),
        output_gate=bool(text.get("mla_use_output_gate", False)),
    )
    num_experts = t.size("num_experts", 0)
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=t.size("num_experts_per_token", 0),
        intermediate_size=t.size("moe_intermediate_size", 0),
        num_shared_experts=t.size("num_shared_experts", 0),
        routed_scaling_factor=t.real("routed_scaling_factor", 1.0, 1e-6, 1e3),
        renormalize=bool(text.get("moe_renormalize", text.get("norm_topk_prob", True))),
        latent_size=t.optional_size("routed_expert_hidden_size"),
        latent_norm=bool(text.get("latent_moe_use_norm", False)),
    )
    if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(
            f"{source}: moe_router_activation_func={text['moe_router_activation_func']!r}; only sigmoid"
        )
    mlp_kinds = _mlp_kinds(text, n, source, t)
    if "moe" in mlp_kinds and (moe.num_experts <= 0 or not 0 < moe.top_k <= moe.num_experts
                               or moe.intermediate_size <= 0):
        raise ConfigValueError(f"{source}: MoE layers need 0 < num_experts_per_token ({moe.top_k}) <= num_experts "
                               f"({moe.num_experts}) and moe_intermediate_size ({moe.intermediate_size}) >= 1")
    intermediate_size = t.size("intermediate_size", 0)
    if "dense" in mlp_kinds and intermediate_size <= 0:
        raise ConfigValueError(f"{source}: dense MLP layers need intermediate_size >= 1, got {intermediate_size}")
    vocab_size = t.size("vocab_size")
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=t.size("hidden_size"),
        num_layers=n,
        rms_norm_eps=t.real("rms_norm_eps", 1e-5, 1e-12, 0.1),
        intermediate_size=intermediate_size,
        layer_map=LayerMap.from_kinds(_layer_kinds(text, lin, n, source, t)),
        mlp_kinds=mlp_kinds,
        kda=kda,
        mla=mla,
        moe=moe,
        activation=act,
        situ_beta=t.real("activation_situ_beta", 4.0, 1e-6, 1e6),
        situ_linear_beta=t.real("activation_situ_linear_beta", 25.0, 1e-6, 1e6),
        attn_res_block_size=t.optional_size("attn_res_block_size"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        max_position_embeddings=t.size("max_position_embeddings", 1 << 20),
        bos_token_id=t.token_id("bos_token_id", vocab_size),
        eos_token_ids=t.token_ids("eos_token_id", vocab_size),
        pad_token_id=t.token_id("pad_token_id", vocab_size),
        torch_dtype=str(text.get("torch_dtype", text.get("dtype", raw.get("torch_dtype", "bfloat16")))),
        quantization=_quantization(text, source) or _quantization(raw, source),
        tensor_prefix="language_model." if model_type == "kimi_k3" else "",
    )


_PARSERS = {
    "kimi_linear": lambda raw, source: _parse(raw, source, "kimi_linear"),
    "kimi_k3": lambda raw, source: _parse(raw, source, "kimi_k3"),
}
