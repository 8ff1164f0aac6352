"""Generation through the real stack: equality with offline generate, usage, stop strings, cancellation."""

from __future__ import annotations

import threading

import grpc
import pytest

from kimiserve.v1 import common_pb2, router_pb2
from tests.services.helpers import cli_json, generate, shard_load, wait_until

PROMPT = "The quick brown fox"


@pytest.mark.parametrize("flags", [
    ["--max-tokens", "12", "--ignore-eos"],
    ["--max-tokens", "12", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--seed", "7",
     "--ignore-eos"],
], ids=["greedy", "sampled"])
def test_service_output_equals_offline_generate(stack, tiny_k3, flags):
    offline = cli_json("generate", "--model", str(tiny_k3), "--prompt", PROMPT, "--json", *flags)
    served = cli_json("complete", "--router", stack.router, "--prompt", PROMPT, "--json", *flags)
    assert served == offline
    assert served["usage"] == {"prompt_tokens": served["usage"]["prompt_tokens"], "completion_tokens": 12}


def test_32_concurrent_streams_complete_with_exact_usage(stack):
    results, errors = {}, []

    def one(i: int) -> None:
        try:
            prompt = [(i * 37 + j) % 500 + 1 for j in range(5 + i % 11)]
            ids, _, last = generate(stack.stub, ids=prompt, max_tokens=4 + i % 5, temperature=0.0, ignore_eos=True)
            results[i] = (prompt, ids, last)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(results) == 32
    for i, (prompt, ids, last) in results.items():
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(ids) == 4 + i % 5
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(ids))
    # Both shards took work.
    assert all(shard_load(stack.shard(i).address).running_seqs == 0 for i in (0, 1))


def test_concurrent_result_equals_single_result(stack):
    alone = generate(stack.stub, ids=[3, 1, 4, 1, 5], max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    crowd = {}

    def one(i):
        crowd[i] = generate(stack.stub, ids=[3, 1, 4, 1, 5] if i == 0 else [i, i + 1, i + 2] * i,
                            max_tokens=8, temperature=0.0, ignore_eos=True)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    assert crowd[0] == alone


def test_max_tokens_one(stack):
    ids, _, last = generate(stack.stub, ids=[10, 20, 30], max_tokens=1, temperature=0.0)
    assert len(ids) == 1 and last.usage.completion_tokens == 1 and last.usage.prompt_tokens == 3
    assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)


def test_stop_string_cuts_text_and_counts_tokens(stack):
    ids, text, _ = generate(stack.stub, text=PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
    visible = text.strip()
    assert len(visible) >= 6, f"need some text to pick a stop string from, got {text!r}"
    stop = visible[len(visible) // 2: len(visible) // 2 + 2]
    cut = text[: text.find(stop)]
    ids2, text2, last = generate(stack.stub, text=PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True,
                                 stop=[stop])
    assert text2 == cut
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert ids2 == ids[: len(ids2)] and len(ids2) < len(ids)
    assert last.usage.completion_tokens == len(ids2)


def test_cancel_frees_slots_and_blocks(stack):
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=400, temperature=0.0,
                                                                        ignore_eos=True))
    req.prompt_token_ids.ids.extend([5] * 50)
    call = stack.stub.Generate(req, timeout=120)
    next(call)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED

    def idle() -> bool:
        loads = [shard_load(stack.shard(i).address) for i in (0, 1)]
        return all(lo.running_seqs == 0 and lo.free_state_slots == 8 and lo.free_kv_blocks == 256 for lo in loads)

    wait_until(idle, 30, "both shards idle with every slot and block free")


def test_deadline_is_propagated_to_the_shard(stack):
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=450, temperature=0.0,
                                                                        ignore_eos=True))
    req.prompt_token_ids.ids.extend([7] * 20)
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(req, timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: all(shard_load(stack.shard(i).address).running_seqs == 0 for i in (0, 1)), 30,
               "the shard to drop the sequence after the deadline")


def test_client_request_id_is_echoed(stack):
    req = router_pb2.GenerateRequest(request_id="client-id-0001-full-length-kept",
                                     sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
    req.prompt_token_ids.ids.extend([1, 2, 3])
    chunks = list(stack.stub.Generate(req, timeout=60))
    assert {c.request_id for c in chunks} == {"client-id-0001-full-length-kept"}
    chunks = list(stack.stub.Generate(router_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=[1, 2]), sampling=common_pb2.SamplingParams(max_tokens=1)),
        metadata=(("x-request-id", "from-metadata-42"),), timeout=60))
    assert chunks[-1].request_id == "from-metadata-42"


def test_chat_streams_a_reply_and_lists_models(stack):
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Hello")],
                                 sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.8, seed=1))
    chunks = list(stack.stub.Chat(req, timeout=60))
    last = chunks[-1]
    assert last.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks) > 0
    assert "<|im_end|>" not in "".join(c.text for c in chunks)
    models = stack.stub.ListModels(router_pb2.ListModelsRequest(), timeout=10).models
    assert [m.model_type for m in models] == ["kimi_k3"]
