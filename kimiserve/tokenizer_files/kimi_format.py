"""Constants of the Kimi (K2 family) tokenizer, shared by Kimi-Linear and Kimi-K3 (docs/models.md#special-tokens)."""

from __future__ import annotations

# The pre-tokenizer split pattern of Kimi's tiktoken tokenizer (tokenization_kimi.py `pat_str`): Han runs split off
# on their own, case-aware letter runs with English contractions attached, digits in groups of at most three,
# punctuation runs, newline runs and whitespace. `&&` is character-class intersection (Oniguruma and fancy-regex).
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# 256 reserved special ids follow the base (BPE) vocabulary; offsets from its first id (163584 in the real models).
NUM_RESERVED_SPECIAL_TOKENS = 256
KIMI_SPECIAL_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}

END_OF_TURN = "<|im_end|>"


def kimi_special_tokens(num_base_tokens: int) -> dict[int, str]:
    """id -> content of all 256 reserved ids; unnamed ones are `<|reserved_token_{id}|>` as in tokenization_kimi.py."""
    return {
        num_base_tokens + off: KIMI_SPECIAL_OFFSETS.get(off, f"<|reserved_token_{num_base_tokens + off}|>")
        for off in range(NUM_RESERVED_SPECIAL_TOKENS)
    }
