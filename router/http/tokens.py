"""POST /tokenize and POST /detokenize, vLLM's token-counting endpoints at the server root.

/tokenize takes vLLM's completion body (`prompt`) or chat body (`messages`) and answers the ids the completion and
chat flows would prefill for it: the body goes through the same parser (router/openai_body.py), size limits, model
check and tokenizer call (router/flow.py) as /v1/completions and /v1/chat/completions, so a count taken here is the
`usage.prompt_tokens` of the same request. A chat is rendered as the caller's tenant (flow.chat_prompt keys the
tokenizer's cache of rendered pieces by it), so how fast a rendering comes back tells nothing about other tenants.
/detokenize turns ids back into text, special tokens included, as the model saw them.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from kimiserve import limits, sampling_rules
from kimiserve.tenants import Tenant
from router import flow, openai_body, openai_fields, prompts
from router.errors import InvalidArgument
from router.generation import Generation
from router.http import replies, schemas
# The body parser's own type checks, so a field is refused in the same words as on the other endpoints.
from router.openai_body import BodyError, bool_field, describe, is_int, str_field

TOKENIZE_METHOD, DETOKENIZE_METHOD = "HttpTokenize", "HttpDetokenize"  # the metrics' method labels
COMMON_FIELDS = {"model", "return_token_strs"}
PROMPT_FIELDS = {"prompt"}
CHAT_FIELDS = {"messages", "tools", "add_generation_prompt", "continue_final_message"}
# The rest of vLLM's /tokenize fields: add_special_tokens changes nothing here; the others would change the ids and
# are not honoured.
RULES = openai_fields.Rules(ignored={
    "add_special_tokens": (bool, "the tokenizer adds no special tokens of its own (no BOS; a chat's come from its "
                                 "template), so either value gives the ids the completion and chat flows prefill"),
}, no_op_values={}, refused={
    "chat_template": "the chat template is the tokenizer service's (the checkpoint's, or the built-in Kimi format)",
    "chat_template_kwargs": "the chat template takes no arguments here",
    "mm_processor_kwargs": "there is no multimodal input",
})


async def tokenize(gen: Generation, body: dict, request_id: str, tenant: Tenant, receive) -> JSONResponse:
    body = openai_body.present(body)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise BodyError("give either prompt (text, as /v1/completions takes it) or messages (a chat, as "
                        "/v1/chat/completions takes it)" + (", not both" if chat else ""),
                        "messages" if chat else "prompt")
    _check_fields(body, COMMON_FIELDS | (CHAT_FIELDS if chat else PROMPT_FIELDS))
    ids = await (_chat_ids(gen, body, tenant) if chat else _prompt_ids(gen, body))
    reply = schemas.TokenizeResponse(count=len(ids), max_model_len=gen.max_context_tokens(), tokens=ids)
    if bool_field(body, "return_token_strs"):  # each id named as logprobs name it (replies.token_key)
        names = await gen.tokenizer.token_bytes(ids) if ids else {}
        reply.token_strs = [replies.token_key(i, names[i]) for i in ids]
    return JSONResponse(reply.model_dump(exclude_none=True))


async def detokenize(gen: Generation, body: dict, request_id: str, tenant: Tenant,
                     receive) -> schemas.DetokenizeResponse:
    body = openai_body.present(body)
    _check_fields(body, {"model", "tokens"})
    model, ids = str_field(body, "model"), body.get("tokens")
    if not isinstance(ids, list):
        raise BodyError(f"tokens must be a list of token ids, got {describe(ids)}", "tokens")
    if (bad := next((i for i, t in enumerate(ids) if not is_int(t)), None)) is not None:
        raise BodyError(f"tokens[{bad}] must be a token id (an integer), got {describe(ids[bad])}", "tokens")
    if len(ids) > limits.MAX_PROMPT_TOKEN_IDS:  # the limit on a completion's prompt ids
        raise InvalidArgument(f"tokens: {len(ids):,} ids is over the limit of {limits.MAX_PROMPT_TOKEN_IDS:,}",
                              "tokens")
    prompts.check_model(gen, model)
    # The ids a completion takes as its prompt: the model's vocabulary (ids past the tokenizer's decode to "").
    if problems := sampling_rules.token_id_problems("tokens", ids, gen.model_info().vocab_size):
        raise InvalidArgument(*sampling_rules.describe(problems))
    return schemas.DetokenizeResponse(prompt=await gen.tokenizer.detokenize(ids) if ids else "")


async def _prompt_ids(gen: Generation, body: dict[str, Any]) -> list[int]:
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise BodyError(f"prompt must be a string, got {describe(prompt)}", "prompt")
    if not prompt:  # a completion refuses an empty prompt; counting one is fine: it has no tokens
        prompts.check_model(gen, str_field(body, "model"))
        return []
    (req,), _ = openai_body.completion_requests({k: body[k] for k in ("model", "prompt") if k in body})
    return (await flow.completion_prompt(gen, req)).ids


async def _chat_ids(gen: Generation, body: dict[str, Any], tenant: Tenant) -> list[int]:
    req, _ = openai_body.chat_request({k: body[k] for k in CHAT_FIELDS | {"model"} if k in body})
    return (await flow.chat_prompt(gen, req, tenant)).ids


def _check_fields(body: dict[str, Any], honoured: set[str]) -> None:
    try:
        openai_fields.check(body, honoured, RULES)
    except openai_fields.FieldError as e:
        raise BodyError(str(e), e.field) from None

