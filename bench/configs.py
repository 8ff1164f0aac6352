"""Full-size model configs for benchmarks (values from docs/models.md#reference-sizes), as config.json dicts."""

KIMI_LINEAR_48B = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
    "num_attention_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-5, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "moe_router_activation_func": "sigmoid",
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "model_max_length": 1048576,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]},
}


def with_layers(raw: dict, layers: int | None) -> dict:
    """raw with only `layers` decoder layers (None: as it is): an MLA layer every fourth and the last, KDA layers the
    rest. For quick runs, and for the 48B width on a GPU that cannot hold all 27 layers; per-layer costs scale."""
    if not layers:
        return raw
    full = sorted(set(range(4, layers + 1, 4)) | {layers})
    return {**raw, "num_hidden_layers": layers,
            "linear_attn_config": {**raw["linear_attn_config"], "full_attn_layers": full,
                                   "kda_layers": [i for i in range(1, layers + 1) if i not in full]}}
