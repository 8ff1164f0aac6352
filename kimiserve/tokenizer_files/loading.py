"""Load a Kimi tokenizer from a checkpoint directory.

Two formats: `tokenizer.json` (HF tokenizers, preferred because it loads fastest) or the Kimi `tiktoken.model`
plus `tokenizer_config.json`, converted at load into an equivalent HF byte-level BPE. Only byte-level BPE is
accepted: the detokenizer needs every token's exact bytes, and a tokenizer of another kind is refused rather than
decoded approximately.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders

from kimiserve.text import encodable
from kimiserve.tokenizer_files.bpe import build_bpe_tokenizer, merges_from_ranks, read_tiktoken_model, unicode_to_bytes
from kimiserve.tokenizer_files.errors import TokenizerLoadError
from kimiserve.tokenizer_files.kimi_format import END_OF_TURN, kimi_special_tokens

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class LoadedTokenizer:
    """A loaded tokenizer and the facts about it the services need. Immutable, so threads share it freely."""

    hf: Tokenizer
    source: str  # which file it came from: "tokenizer.json" or "tiktoken.model"
    special_tokens: Mapping[int, str]  # id -> content, every added special token
    token_bytes: tuple[bytes, ...]  # index = id: the exact bytes each token decodes to
    eos_token_ids: tuple[int, ...]  # ids that end generation: the configured EOS and <|im_end|>
    bos_token_id: int | None
    config: Mapping[str, object]  # tokenizer_config.json ({} when absent)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows: base vocab + special tokens. Checkpoints may pad their model vocab past it."""
        return len(self.token_bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings become their ids. No BOS (the Kimi format never adds one).

        Surrogates are fixed first as Kimi's tiktoken tokenizer fixes them (pairs joined, a lone one is U+FFFD;
        kimiserve/text.py): `tokenizers` refuses text that is not encodable as UTF-8."""
        return self.hf.encode(encodable(text), add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids past the vocab decode to nothing; bytes that are not UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        table, special = self.token_bytes, self.special_tokens
        return b"".join(
            table[i] for i in ids if i < len(table) and not (skip_special_tokens and i in special)
        )

    def token_id(self, content: str) -> int | None:
        return self.hf.token_to_id(content)


def read_tokenizer_config(model_dir: Path) -> dict[str, object]:
    path = model_dir / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(f"{path}: not valid JSON: {exc}") from exc


def _configured_specials(config: Mapping[str, object], path: Path) -> dict[int, str]:
    """`added_tokens_decoder` of tokenizer_config.json: {"163584": {"content": "[BOS]", ...}, ...}."""
    decoder = config.get("added_tokens_decoder") or {}
    try:
        return {int(k): str(v["content"]) for k, v in decoder.items()}  # type: ignore[union-attr,index]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise TokenizerLoadError(f"{path}: malformed added_tokens_decoder: {exc!r}") from exc


def _from_tiktoken(model_dir: Path, config: Mapping[str, object]) -> tuple[Tokenizer, dict[int, str]]:
    ranks = read_tiktoken_model(model_dir / TIKTOKEN_MODEL)
    # 256 reserved ids right after the base vocab (docs/models.md#special-tokens); the config's names override them.
    specials = kimi_special_tokens(len(ranks)) | _configured_specials(config, model_dir / TOKENIZER_CONFIG)
    return build_bpe_tokenizer(ranks, merges_from_ranks(ranks), specials), specials


def _token_id_of(config: Mapping[str, object], key: str, hf: Tokenizer) -> int | None:
    value = config.get(key)
    content = value.get("content") if isinstance(value, dict) else value
    return hf.token_to_id(content) if isinstance(content, str) else None


def _token_bytes(hf: Tokenizer, specials: Mapping[int, str], model_dir: Path) -> tuple[bytes, ...]:
    size = hf.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = [b""] * size
    byte_of = unicode_to_bytes()
    for token, token_id in hf.get_vocab(with_added_tokens=False).items():
        try:
            table[token_id] = bytes(byte_of[c] for c in token)
        except KeyError as exc:
            raise TokenizerLoadError(f"{model_dir}: token {token_id} {token!r} is not a byte-level token") from exc
    for token_id, added in hf.get_added_tokens_decoder().items():
        table[token_id] = added.content.encode("utf-8")
    return tuple(table)


def has_tokenizer(model_dir: Path) -> bool:
    """Whether `model_dir` holds tokenizer files (a checkpoint may ship weights alone: token ids still work)."""
    return any((Path(model_dir) / f).is_file() for f in (TOKENIZER_JSON, TIKTOKEN_MODEL))


def load_tokenizer(model_dir: Path) -> LoadedTokenizer:
    """Load the tokenizer of the checkpoint in `model_dir` (tokenizer.json, else tiktoken.model)."""
    start = time.perf_counter()
    config = read_tokenizer_config(model_dir)
    if (model_dir / TOKENIZER_JSON).is_file():
        source = TOKENIZER_JSON
        try:
            hf = Tokenizer.from_file(str(model_dir / TOKENIZER_JSON))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerLoadError(f"{model_dir / TOKENIZER_JSON}: cannot load: {exc}") from exc
        specials = {i: t.content for i, t in hf.get_added_tokens_decoder().items() if t.special}
    elif (model_dir / TIKTOKEN_MODEL).is_file():
        source = TIKTOKEN_MODEL
        hf, specials = _from_tiktoken(model_dir, config)
    else:
        raise TokenizerLoadError(f"{model_dir}: neither {TOKENIZER_JSON} nor {TIKTOKEN_MODEL} found")
    if not isinstance(hf.decoder, decoders.ByteLevel):
        raise TokenizerLoadError(
            f"{model_dir / source}: decoder is {type(hf.decoder).__name__}, only byte-level BPE tokenizers are served"
        )
    eos = {i for i in (_token_id_of(config, "eos_token", hf), hf.token_to_id(END_OF_TURN)) if i is not None}
    loaded = LoadedTokenizer(
        hf=hf,
        source=source,
        special_tokens=specials,
        token_bytes=_token_bytes(hf, specials, model_dir),
        eos_token_ids=tuple(sorted(eos)),
        bos_token_id=_token_id_of(config, "bos_token", hf),
        config=config,
    )
    log.info(
        "tokenizer loaded",
        extra={"model_dir": str(model_dir), "source": source, "vocab_size": loaded.vocab_size,
               "special_tokens": len(specials), "load_s": round(time.perf_counter() - start, 3)},
    )
    return loaded
