"""SplitRule: every offset it accepts is one where encoding the two sides alone gives the whole text's ids, on random
texts built to hit the cases that break a split (merges across it, added tokens spanning it, lstrip / rstrip /
single_word tokens beside it), for the tiny Kimi tokenizer and for one with such added tokens."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer

from kimiserve.tokenizer_files.loading import load_tokenizer
from kimiserve.tokenizer_files.splits import SplitRule
from launcher.up import DEFAULT_MODEL_DIR

FRAGMENTS = ("<|im_end|>", "<|im_user|>", "<|im_system|>", "<|im_middle|>", "[BOS]", "<think>", "</think>", "<",
             ">", "|", "!", "!<", "><", "x<", " ", "  ", "\n", "the", "a", "_", "é", "日本", "1", ".", '"', "--",
             ",",
             "<|z|>", "<|w|>", "<|v|>")


def _adversarial(tok) -> Tokenizer:
    """The tiny tokenizer plus added tokens that break splits: ones spanning a turn boundary's characters, and ones
    that take whitespace or want word boundaries beside them."""
    hf = Tokenizer.from_str(tok.hf.to_str())
    hf.add_special_tokens(["!<", "<|im_end|><|im_user|>"])
    hf.add_tokens([AddedToken("<|z|>", lstrip=True, normalized=False),
                   AddedToken("<|w|>", rstrip=True, normalized=False),
                   AddedToken("<|v|>", single_word=True, normalized=False)])
    return hf


def _encode(hf: Tokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("which", ["tiny", "adversarial", "trained"])
def test_every_accepted_offset_splits_the_encoding_exactly(tok, which):
    # the trained default's tokenizer merges punctuation ('."', '--"'): a cut between two such characters is refused
    hf = {"tiny": lambda: tok.hf, "adversarial": lambda: _adversarial(tok),
          "trained": lambda: load_tokenizer(DEFAULT_MODEL_DIR).hf}[which]()
    rule, rng, accepted = SplitRule(hf), random.Random(0), 0
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 12)))
        whole = _encode(hf, text)
        for at in range(len(text) + 1):
            if rule.splits_at(text, at):
                accepted += 1
                assert _encode(hf, text[:at]) + _encode(hf, text[at:]) == whole, (text, at)
    assert accepted > 500  # the rule accepts a real share of offsets, so the check above has teeth


def test_it_refuses_the_offsets_that_do_not_split(tok):
    hf = _adversarial(tok)
    rule = SplitRule(hf)
    turn = "hi<|im_end|><|im_user|>"
    cut = turn.index("<|im_user|>")
    assert SplitRule(tok.hf).splits_at(turn, cut), "the Kimi turn boundary splits in the Kimi tokenizer"
    for text, at in ((turn, cut),  # "<|im_end|><|im_user|>", an added token, spans it
                     ("a!<|im_user|>", 2),  # "!<" spans it
                     ("a. <|z|>", 3),  # <|z|> takes the space before it (lstrip)
                     ("<|w|> b", 5),  # <|w|> takes the space after it (rstrip)
                     ("the<|im_end|>", 3),  # a word character beside it
                     ("!x", 1)):  # no added token starts there
        assert not rule.splits_at(text, at), (text, at)
    # ... and at the first four, encoding the sides alone really gives other ids
    for text, at in ((turn, cut), ("a!<|im_user|>", 2), ("a. <|z|>", 3), ("<|w|> b", 5)):
        assert _encode(hf, text[:at]) + _encode(hf, text[at:]) != _encode(hf, text), (text, at)


def test_the_ends_of_a_text_always_split(tok):
    rule = SplitRule(tok.hf)
    assert rule.splits_at("the", 0) and rule.splits_at("the", 3) and not rule.splits_at("the", 4)
