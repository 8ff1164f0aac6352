"""The trained models of models/ as the parity instrument: with well-conditioned weights a correct fast path gives the
reference's greedy tokens, token for token, and a wrong one does not.

`KIMISERVE_TRAINED_MODELS=DIR` points these tests at other trained checkpoints (e.g. a fresh `python3 -m training`
output) before they are committed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kimiserve.tokenizer_files.loading import load_tokenizer
from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import Ops, select_ops
from tokenizer_svc.chat_types import ChatMessage
from tokenizer_svc.kimi_chat import BuiltinKimiTemplate

MODELS_DIR = Path(os.environ.get("KIMISERVE_TRAINED_MODELS", Path(__file__).resolve().parents[2] / "models"))
LINEAR = "kimi-linear-austen"
K3 = "kimi-k3-austen"
CHATS = ["Hello", "Who wrote Emma?", "Tell me a story."]
# Greedy tokens and chat prompts of the reference runs, per model.
TOKENS = {LINEAR: 128}
PROMPTS = {LINEAR: 3}
CPU = torch.device("cpu")
BLOCK = 16


def model_dir(name: str) -> Path:
    path = MODELS_DIR / name
    if not (path / "config.json").is_file():
        # Every model these tests name is committed: a missing one is a broken checkout or a wrong
        # KIMISERVE_TRAINED_MODELS, never a case to skip.
        pytest.fail(f"trained model {name!r}: {path / 'config.json'} does not exist (models/ in the checkout, or "
                    f"KIMISERVE_TRAINED_MODELS=DIR naming another training run)")
    return path


def chat_ids(path: Path) -> list[list[int]]:
    """The model's chat prompts (PROMPTS of CHATS), rendered in the Kimi format with the default system turn."""
    tok = load_tokenizer(path)
    template = BuiltinKimiTemplate()
    return [tok.encode(template.render([ChatMessage("user", c)], (), add_generation_prompt=True))
            for c in CHATS[:PROMPTS.get(path.name, 1)]]


@dataclass
class Run:
    tokens: list[list[int]]
    logits: list[torch.Tensor]  # [TOKENS, vocab] per prompt: the logits each generated token was chosen from
    prompt_logits: list[torch.Tensor]  # [prompt length, vocab] per prompt
    finish_reasons: list[str | None]  # "length" on a whole run; "error" where a pass failed
    errors: list[str | None]


def generate(engine: Engine, prompts: list[list[int]], tokens: int, ignore_eos: bool = True) -> Run:
    """Greedy, all prompts in one batch: with EOS ignored (the default) a working engine gives exactly `tokens` tokens
    per sequence and finishes each with "length"; a failed pass shows as finish_reason "error" and a short output."""
    seqs = [engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                          ignore_eos=ignore_eos), keep_prompt_logits=True)
            for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return Run([s.output for s in seqs], [torch.cat(s.step_logits) for s in seqs],
               [torch.cat(s.prompt_logits) for s in seqs], [s.finish_reason for s in seqs], [s.error for s in seqs])


def engine_for(path: Path, ops: Ops | None = None, kv_metrics=None, **config) -> Engine:
    """The checkpoint in float32 on the CPU, eager unless `ops`; `config` overrides the engine's pool sizes."""
    cfg, model = load_model(path, dtype=torch.float32)
    kw = dict(num_state_slots=PROMPTS.get(path.name, 1), num_kv_blocks=64, kv_block_size=BLOCK,
              prefill_token_budget=512)
    return Engine(cfg, model, ops or select_ops(CPU, "eager"), CPU, EngineConfig(**{**kw, **config}),
                  kv_metrics=kv_metrics)


def assert_same_tokens(ref: Run, got: Run, what: str, logits_tol: float | None = None) -> None:
    """The whole run, never a prefix of it: a pass that fails after some tokens ends short with finish_reason "error",
    and a comparison cut to the shorter run would pass it."""
    assert len(got.tokens) == len(ref.tokens), f"{what}: {len(got.tokens)} sequences, the reference {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=True)):
        assert got.finish_reasons[i] == ref.finish_reasons[i], (
            f"{what}: prompt {i} ({CHATS[i]!r}) finished {got.finish_reasons[i]!r} after {len(b)} tokens "
            f"(error: {got.errors[i]}), the reference {ref.finish_reasons[i]!r} after {len(a)}")
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, (f"{what}: prompt {i} ({CHATS[i]!r}) differs from the reference at token {first} "
                        f"({len(b)} tokens, the reference {len(a)})")
    if logits_tol is not None:
        for i, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
            assert a.shape == b.shape, f"{what}: prompt {i} logits {tuple(b.shape)}, the reference {tuple(a.shape)}"
            err = float((a - b).abs().max() / a.abs().max())
            assert err <= logits_tol, f"{what}: logits differ by {err:.2e} of the largest"


@pytest.fixture(scope="session")
def reference():
    """name -> the eager, resident, one-process run (float32) of every chat prompt: what the others must give."""
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            path = model_dir(name)
            run = generate(engine_for(path), chat_ids(path), TOKENS[name])
            # The reference is the yardstick: it must itself be whole.
            assert run.finish_reasons == ["length"] * len(run.tokens), f"reference {name}: {run.errors}"
            assert [len(t) for t in run.tokens] == [TOKENS[name]] * len(run.tokens)
            cache[name] = run
        return cache[name]

    return get
