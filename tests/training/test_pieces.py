"""The training script's pieces: corpus file and R data reader, tokenizer, dialogues and their masks, packing, and
the checkpoint writer (the loader's inverse)."""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import zlib

import pytest
import torch

from shard_svc.checkpoint.loader import load_model
from shard_svc.checkpoint.writer import published_tensors, write_shards
from shard_svc.config import ModelConfig
from tests.engine.conftest import k3_config, random_model
from tokenizer_svc.chat_types import ChatMessage
from tokenizer_svc.kimi_chat import BuiltinKimiTemplate
from training.corpus import CORPUS_FILE, NOVELS, load_corpus
from training.data import pack_dialogues
from training.dialogues import make_dialogues, tokenize_dialogue
from training.evaluate import Lexicon
from training.models import round_experts_to_mxfp4
from training.mxfp4 import mxfp4_round
from training.rdata import read_lazy_load
from training.tokenizer import learn_bpe, train_tokenizer

CORPUS_SHA256 = "e575b5436133f6b655b835f372b96a4f9e443be97c5791cc6ced8aaa7153c2f4"


def test_committed_corpus_is_the_derived_one_with_six_novels():
    assert hashlib.sha256(CORPUS_FILE.read_bytes()).hexdigest() == CORPUS_SHA256
    assert CORPUS_SHA256 in (CORPUS_FILE.parent / "README.md").read_text()
    corpus = load_corpus()
    assert list(corpus.train_by_novel) == list(NOVELS.values())
    assert corpus.train_by_novel["Pride and Prejudice"][0].startswith("It is a truth universally acknowledged")
    assert 400 < len(corpus.held_out) < 600
    assert corpus.held_out[-1].startswith("Mrs Smith's enjoyments") and corpus.held_out[-1].endswith("importance.")
    for novel in corpus.train_by_novel.values():
        assert not [p for p in novel if p.startswith(("CHAPTER", "Chapter", "VOLUME", "*"))], "headings are prose?"


def _xdr_strings(values: list[str]) -> bytes:
    """R serialization (version 2, XDR) of a character vector."""
    out = b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300) + struct.pack(">ii", 16, len(values))
    for v in values:
        raw = v.encode()
        out += struct.pack(">ii", 9 | (1 << 15), len(raw)) + raw  # CHARSXP, UTF-8 flag
    return out


def test_the_lexicon_counts_corpus_words_and_word_pairs():
    lexicon = Lexicon.of(["It is a truth universally acknowledged, that a single man", "Mr. Darcy's pride."])
    assert lexicon.english("It is a single man") == (1.0, 1.0, 1.0)
    assert lexicon.english("a truth Darcy's") == (1.0, 0.5, 1.0)  # case-blind; "truth darcy's" is no corpus pair
    assert lexicon.english("a truthxq, man man") == (0.75, 0.0, 1.0)
    assert lexicon.english("a single a single a single") == (1.0, 0.6, 0.4)  # ("a", "single") thrice of 5 pairs
    assert lexicon.english("pride") == (1.0, 0.0, 0.0)
    assert lexicon.english(" ,.;") == (0.0, 0.0, 0.0)


def test_rdata_reads_a_lazy_load_database():
    blob = _xdr_strings(["It is a truth", "", "universally acknowledged"])
    entry = struct.pack(">I", len(blob)) + zlib.compress(blob)
    # index: list(variables = list(book = c(0, len)), ...) with names attributes
    names_sym = struct.pack(">i", 1) + struct.pack(">ii", 9, 5) + b"names"

    def named(kind: int, items: bytes, count: int, names: list[str], first_names: bool) -> bytes:
        head = struct.pack(">ii", kind | (1 << 9), count) + items
        attr = struct.pack(">i", 2 | (1 << 10)) + (names_sym if first_names else struct.pack(">i", 255 | (1 << 8)))
        return head + attr + struct.pack(">ii", 16, len(names)) + b"".join(
            struct.pack(">ii", 9, len(n)) + n.encode() for n in names) + struct.pack(">i", 254)

    offsets = struct.pack(">ii", 13, 2) + struct.pack(">ii", 0, len(entry))
    variables = named(19, offsets, 1, ["book"], first_names=True)
    index = b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300) + named(19, variables, 1, ["variables"], False)
    objects = read_lazy_load(gzip.compress(index), entry, "test")
    assert objects == {"book": ["It is a truth", "", "universally acknowledged"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = load_corpus()
    return train_tokenizer(corpus.train[:400], 512, tmp_path_factory.mktemp("tok"))


def test_tokenizer_has_kimi_specials_after_the_learned_vocab(tokenizer):
    assert tokenizer.vocab_size == 512 + 256
    assert tokenizer.token_id("<|im_end|>") == 514 and tokenizer.token_id("[BOS]") == 512
    assert tokenizer.eos_token_ids == (513, 514)
    text = "Mr. Darcy's letter, dated 1813!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert learn_bpe(load_corpus().train[:400], 512) == learn_bpe(load_corpus().train[:400], 512), "deterministic"


def test_dialogue_ids_are_the_whole_renderings_ids_and_masks_cover_replies(tokenizer):
    corpus = load_corpus()
    dialogues = make_dialogues(50, corpus.train_by_novel, tokenizer, seed=0)
    assert dialogues == make_dialogues(50, corpus.train_by_novel, tokenizer, seed=0)
    im_end = tokenizer.token_id("<|im_end|>")
    for d in dialogues:
        text = tokenizer.decode(d.ids, skip_special_tokens=False)
        assert tokenizer.encode(text) == d.ids
        learned = [i for i, m in zip(d.ids, d.mask, strict=True) if m]
        assert learned[-1] == im_end and text.startswith("<|im_system|>")
        reply = tokenizer.decode(learned, skip_special_tokens=False)
        assert "<|im_user|>" not in reply and "<|im_middle|>" not in reply and reply.endswith("<|im_end|>")


def test_a_dialogue_is_the_chat_services_rendering_of_its_messages(tokenizer):
    """Training text is what the tokenizer service renders for the same turns (tokenizer_svc.kimi_chat), with every
    role kept: a system turn and two exchanges."""
    messages = [ChatMessage("system", "You are terse."), ChatMessage("user", "Who wrote Emma?"),
                ChatMessage("assistant", "Jane Austen."), ChatMessage("user", "When?"),
                ChatMessage("assistant", "In 1815.")]
    d = tokenize_dialogue(messages, tokenizer)
    assert tokenizer.decode(d.ids, skip_special_tokens=False) == \
        BuiltinKimiTemplate().render(messages, (), add_generation_prompt=False)
    replies = tokenizer.decode([i for i, m in zip(d.ids, d.mask, strict=True) if m], skip_special_tokens=False)
    assert "Jane Austen." in replies and "In 1815." in replies and "Who wrote Emma?" not in replies


def test_packed_rows_learn_only_reply_tokens(tokenizer):
    a, b, c = make_dialogues(3, load_corpus().train_by_novel, tokenizer, seed=1)
    seq_len = len(a.ids) + len(b.ids) + 5  # a and b share the first row, c gets the second
    packed = pack_dialogues([a, b, c], seq_len, pad_id=767)
    ids, mask = a.ids + b.ids, a.mask + b.mask
    n = len(ids)
    assert packed.inputs.shape == (2, seq_len)
    assert packed.inputs[0, :n - 1].tolist() == ids[:-1] and set(packed.inputs[0, n - 1:].tolist()) == {767}
    assert packed.targets[0, :n - 1].tolist() == [t if m else -100 for t, m in zip(ids[1:], mask[1:], strict=True)]
    assert set(packed.targets[0, n - 1:].tolist()) == {-100}
    assert packed.inputs[1, :len(c.ids) - 1].tolist() == c.ids[:-1]


def test_writer_then_loader_give_the_model_back(tmp_path):
    raw = k3_config(13, routed_expert_hidden_size=32, moe_intermediate_size=32)
    raw["text_config"]["torch_dtype"] = "bfloat16"
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                  "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 32}}}}
    cfg = ModelConfig.from_dict(raw)
    _, model = random_model(raw, seed=4, dtype=torch.bfloat16)
    assert round_experts_to_mxfp4(model) == 3 * 12  # 12 MoE layers (the first is dense)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    write_shards(published_tensors(cfg, model), tmp_path, shards=3)
    _, loaded = load_model(tmp_path)
    written, read = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert written.keys() == read.keys(), f"only written: {written.keys() - read.keys()}, only read: " \
                                          f"{read.keys() - written.keys()}"
    for name, a in written.items():
        assert torch.equal(a, read[name]), name
    w = next(p for n, p in model.named_parameters() if n.endswith("experts.w1"))
    assert torch.equal(w.float(), mxfp4_round(w)), "rounded experts are fixed points of the rounding"
