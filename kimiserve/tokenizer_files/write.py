"""Write a Kimi-format tokenizer (byte-level BPE + the 256 reserved Kimi special ids) into a checkpoint directory."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from kimiserve.tokenizer_files.bpe import build_bpe_tokenizer
from kimiserve.tokenizer_files.kimi_format import NUM_RESERVED_SPECIAL_TOKENS, kimi_special_tokens


def write_kimi_tokenizer(out_dir: Path, ranks: dict[bytes, int], merges: list[tuple[bytes, bytes]],
                         tiktoken_model: bool) -> int:
    """tokenizer.json (the BPE of `ranks` and the ordered `merges`, specials right after the base vocab) and
    tokenizer_config.json; `tiktoken_model`: also the ranks as `tiktoken.model`, for merge lists that
    `bpe.merges_from_ranks` rebuilds exactly. Returns the vocab size (base + 256 specials)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    specials = kimi_special_tokens(len(ranks))
    build_bpe_tokenizer(ranks, merges, specials).save(str(out_dir / "tokenizer.json"))
    if tiktoken_model:
        by_rank = sorted(ranks.items(), key=lambda item: item[1])
        lines = [f"{base64.b64encode(token).decode('ascii')} {rank}" for token, rank in by_rank]
        (out_dir / "tiktoken.model").write_text("\n".join(lines) + "\n", encoding="ascii")
    config = {
        "added_tokens_decoder": {
            str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for i, c in specials.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1048576,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return len(ranks) + NUM_RESERVED_SPECIAL_TOKENS
