"""The served benchmark's checkpoint (bench/served.py model_dir): the 48B config beside the tiny tokenizer must agree
on the special ids, so the shard starts with structured output on and ends turns on <|im_end|> (issue 25: the config
named eos 163586, past the tokenizer's 768 ids, and the shard died at start-up)."""

from __future__ import annotations

import json

from bench.configs import KIMI_LINEAR_48B
from bench.served import model_dir
from kimiserve.tokenizer_files.loading import load_tokenizer
from shard_svc.config import ModelConfig
from shard_svc.engine.grammar import Grammars


def test_the_48b_config_names_the_tiny_tokenizers_special_ids(tmp_path):
    model = model_dir(tmp_path, tiny=False)
    cfg = ModelConfig.from_dir(model)
    tok = load_tokenizer(model)
    special = tok.special_tokens
    assert special[cfg.bos_token_id] == "[BOS]" and special[cfg.pad_token_id] == "[PAD]"
    assert [special[e] for e in cfg.eos_token_ids] == ["<|im_end|>"]  # Kimi's eos 163586 is <|im_end|> as well
    written = json.loads((model / "config.json").read_text())
    assert {k: v for k, v in written.items() if not k.endswith("_token_id")} == \
        {k: v for k, v in KIMI_LINEAR_48B.items() if not k.endswith("_token_id")}  # the 48B shape, unchanged
    assert Grammars.for_checkpoint(model, cfg.vocab_size, cfg.eos_token_ids).refusal is None
