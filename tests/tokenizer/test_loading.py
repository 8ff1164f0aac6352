"""Loading both formats; the tiktoken -> HF BPE conversion checked against tokenizer.json and a direct
implementation of tiktoken's rank-merge algorithm."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import regex

from kimiserve.tokenizer_files.errors import TokenizerLoadError
from kimiserve.tokenizer_files.kimi_format import KIMI_PAT_STR
from kimiserve.tokenizer_files.loading import LoadedTokenizer, load_tokenizer
from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
from tests.fresh_process import run_python
from tests.tokenizer.texts import MIXED_TEXT

# docs/models.md#special-tokens ids minus the real base (163584), added to the tiny base (512).
EXPECTED_SPECIALS = {
    "[BOS]": 512, "[EOS]": 513, "<|im_end|>": 514, "<|im_user|>": 515, "<|im_assistant|>": 516,
    "<|im_system|>": 522, "<|tool_calls_section_begin|>": 523, "<|tool_calls_section_end|>": 524,
    "<|tool_call_begin|>": 525, "<|tool_call_argument_begin|>": 526, "<|tool_call_end|>": 527,
    "<|im_middle|>": 529, "<think>": 534, "</think>": 535, "[UNK]": 766, "[PAD]": 767,
}


def reference_tiktoken_encode(ranks: dict[bytes, int], specials: dict[str, int], text: str) -> list[int]:
    """tiktoken's algorithm, written out: split off specials, split by the pattern, then per piece merge the
    adjacent pair whose concatenation has the lowest rank until none is a token."""
    pattern = regex.compile(KIMI_PAT_STR, flags=regex.V1)  # V1: `&&` is class intersection, as in fancy-regex
    special_re = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
    ids: list[int] = []
    for part in special_re.split(text):
        if part in specials:
            ids.append(specials[part])
            continue
        for piece in pattern.findall(part):
            data = piece.encode("utf-8")
            if data in ranks:
                ids.append(ranks[data])
                continue
            parts = [bytes([b]) for b in data]
            while True:
                pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
                if not pairs:
                    break
                _, i = min(pairs)
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            ids.extend(ranks[p] for p in parts)
    return ids


def read_ranks(path: Path) -> dict[bytes, int]:
    lines = path.read_text().split()
    return {base64.b64decode(tok): int(rank) for tok, rank in zip(lines[::2], lines[1::2])}


def test_both_formats_and_reference_agree(tok: LoadedTokenizer, tik: LoadedTokenizer, tiny_dir: Path) -> None:
    assert (tok.source, tik.source) == ("tokenizer.json", "tiktoken.model")
    specials = {content: i for i, content in tik.special_tokens.items()}
    expected = reference_tiktoken_encode(read_ranks(tiny_dir / "tiktoken.model"), specials, MIXED_TEXT)
    assert tik.encode(MIXED_TEXT) == expected
    assert tok.encode(MIXED_TEXT) == expected
    assert tok.decode(expected, skip_special_tokens=False) == MIXED_TEXT
    assert len(expected) < len(MIXED_TEXT.encode()) * 0.8, "merges are not being applied"


@pytest.mark.parametrize("which", ["tok", "tik"])
def test_special_ids_follow_the_kimi_layout(which: str, request: pytest.FixtureRequest) -> None:
    t: LoadedTokenizer = request.getfixturevalue(which)
    assert t.vocab_size == 768
    for content, token_id in EXPECTED_SPECIALS.items():
        assert t.token_id(content) == token_id, content
        assert t.special_tokens[token_id] == content
        assert t.encode(content) == [token_id]
    assert t.special_tokens[517] == "<|reserved_token_517|>"  # unnamed ids, named by absolute id
    assert len(t.special_tokens) == 256 and min(t.special_tokens) == 512
    assert t.eos_token_ids == (513, 514)  # the config's EOS and <|im_end|>
    assert t.bos_token_id == 512
    assert t.encode("<|im_user|>hi") == [515, *t.encode("hi")]  # no BOS added


def test_specials_skipped_on_decode_unless_kept(tok: LoadedTokenizer) -> None:
    ids = tok.encode("<|im_assistant|>Hi<|im_end|>")
    assert tok.decode(ids) == "Hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_assistant|>Hi<|im_end|>"
    assert tok.decode([*ids, 768, 1023]) == "Hi"  # ids past the tokenizer's vocab decode to nothing


def test_decode_bytes_table_matches_hf_decode(tok: LoadedTokenizer) -> None:
    ids = tok.encode(MIXED_TEXT)
    assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)


def test_tiny_tokenizer_is_deterministic_per_seed(tmp_path: Path, tiny_dir: Path) -> None:
    # Another process with another hash seed: the fixture's tokenizer was written in this one.
    run_python(f"from pathlib import Path; from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer; "
               f"write_tiny_tokenizer(Path({str(tmp_path / 'same')!r}))")
    write_tiny_tokenizer(tmp_path / "other", seed=1)
    for name in ("tokenizer.json", "tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "same" / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert (tmp_path / "other" / "tiktoken.model").read_bytes() != (tiny_dir / "tiktoken.model").read_bytes()
    assert load_tokenizer(tmp_path / "other").decode(load_tokenizer(tmp_path / "other").encode(MIXED_TEXT),
                                                     skip_special_tokens=False) == MIXED_TEXT


def test_malformed_tiktoken_line_names_file_and_line(tmp_path: Path, tiktoken_dir: Path) -> None:
    lines = (tiktoken_dir / "tiktoken.model").read_text().splitlines()
    lines[3] = "not-base64!! x"
    (tmp_path / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(TokenizerLoadError, match=r"tiktoken.model:4"):
        load_tokenizer(tmp_path)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="neither tokenizer.json nor tiktoken.model"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("which", ["tok", "tik"])
def test_surrogates_are_encoded_as_tiktoken_encodes_them(which: str, request: pytest.FixtureRequest) -> None:
    """A lone surrogate (argv bytes that are not UTF-8, a JSON \\udcff escape) is U+FFFD, a surrogate pair the
    character it spells, as Kimi's tiktoken tokenizer encodes them; `tokenizers` alone raises TypeError."""
    t: LoadedTokenizer = request.getfixturevalue(which)
    assert t.encode("a\udcffb c\ud800") == t.encode("a\ufffdb c\ufffd")
    assert t.encode("\ud83d\ude00 x") == t.encode("\U0001F600 x")
    assert t.decode(t.encode("a\udcffb")) == "a\ufffdb"
