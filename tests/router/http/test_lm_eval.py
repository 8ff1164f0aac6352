"""lm-evaluation-harness's `local-completions` model (the real client, as `lm_eval --model local-completions` runs
it) against the stack: its loglikelihood requests (`echo` + `logprobs` + `max_tokens` 1 on token-id prompts) must
give each request's loglikelihood within 0.02 nats of an eager float32 reference computed here from the same
checkpoint, and agree on is_greedy; and a multiple-choice task, defined locally (no hub download), runs to a
score."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from shard_svc.build import build_engine
from shard_svc.engine.assemble import EngineOptions
from shard_svc.engine.sampling import SamplingParams
from shard_svc.engine.engine import EngineConfig
from tests.router.http.conftest import API_KEY

PAIRS = [("The quick brown fox", " jumps over the lazy dog."), ("Once upon a time", " there was a king"),
         ("Question: what is 2 + 2?\nAnswer:", " 4"), ("She opened the door and", " saw the garden"),
         ("In the morning we", " walked to the river"), ("A", " B C D E F")]
TOLERANCE_NATS = 0.02


@pytest.fixture(scope="module")
def lm(http_stack) -> LocalCompletionsAPI:
    return LocalCompletionsAPI(base_url=http_stack.base + "/v1/completions", model=http_stack.model,
                               tokenizer_backend="huggingface", tokenizer=str(http_stack.model_dir), max_length=512,
                               header={"Authorization": f"Bearer {API_KEY}"}, max_retries=1)


@pytest.fixture(scope="module")
def eager(http_stack):
    built = build_engine(EngineOptions(http_stack.model_dir, "cpu", "float32", op_backend="eager",
                                       config=EngineConfig(num_state_slots=1), grammars=False))
    yield built.engine
    built.close()


def _reference(engine, context: list[int], continuation: list[int], rid: str) -> tuple[float, bool]:
    """log p(continuation | context) and whether each continuation token is the argmax, in float64 from the
    engine's float32 logits at every prompt position."""
    seq = engine.generate(context + continuation, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                          request_id=rid, keep_prompt_logits=True)
    logp = torch.log_softmax(torch.cat(seq.prompt_logits).double(), -1)
    rows = logp[len(context) - 1:len(context) + len(continuation) - 1]
    targets = torch.tensor(continuation)
    return rows.gather(1, targets[:, None]).sum().item(), bool((rows.argmax(-1) == targets).all())


def _greedy_pair(lm, engine) -> tuple[str, str]:
    """(context, the model's own greedy next tokens as text) whose text re-tokenizes to those tokens, so the
    request is greedy and is_greedy is tested both ways."""
    for i, (context, _) in enumerate(PAIRS):
        for n in (2, 1):
            ids = lm.tok_encode(context)
            seq = engine.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                  request_id=f"greedy-{i}-{n}")
            continuation = lm.decode_batch([seq.output])[0]
            if lm._encode_pair(context, continuation) == (ids, seq.output):
                return context, continuation
    raise AssertionError("no greedy continuation of PAIRS' contexts re-tokenizes to itself")


def test_loglikelihoods_match_the_eager_reference(lm, eager):
    pairs = [*PAIRS, _greedy_pair(lm, eager)]
    requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(pairs)
    refs = [_reference(eager, *lm._encode_pair(*pair), f"ref-{i}") for i, pair in enumerate(pairs)]
    assert refs[-1][1] and not all(greedy for _, greedy in refs)
    errors = [abs(ll - ref_ll) for (ll, _), (ref_ll, _) in zip(got, refs)]
    assert max(errors) <= TOLERANCE_NATS, errors
    assert [greedy for _, greedy in got] == [greedy for _, greedy in refs]


def test_a_local_multiple_choice_task_runs(lm, tmp_path):
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in [
        {"question": "The sky is", "choices": [" blue", " green", " loud"], "label": 0},
        {"question": "Two plus two is", "choices": [" four", " seven"], "label": 0},
        {"question": "Fish live in", "choices": [" trees", " water", " clouds"], "label": 1}]))
    (tmp_path / "kimiserve_mc.yaml").write_text(
        "task: kimiserve_mc\noutput_type: multiple_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    out = evaluator.simple_evaluate(model=lm, tasks=["kimiserve_mc"], task_manager=TaskManager(
        include_path=str(tmp_path), include_defaults=False), log_samples=True)
    result = out["results"]["kimiserve_mc"]
    assert 0.0 <= result["acc,none"] <= 1.0
    samples = out["samples"]["kimiserve_mc"]
    assert len(samples) == 3 and all(len(s["resps"]) == len(s["doc"]["choices"]) for s in samples)
