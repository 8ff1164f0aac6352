"""Which OpenAI request-body fields this server honours, which it accepts and ignores, and which it refuses.

Every field of OpenAI's chat/completions and completions references falls in one of three groups:

- honoured: translated into the Router request (router/openai_body.py), with the fields of other servers' APIs
  in EXTENSIONS (and CHAT_EXTENSIONS, COMPLETIONS_EXTENSIONS: those of one endpoint);
- IGNORED: accepted with any value of the right type, because no value can change the reply (bookkeeping, routing
  and latency hints of OpenAI's own service);
- NO_OP_VALUES: accepted only at the values that change nothing (a default, or the one thing this server does), and
  refused at any other, since honouring it would change the reply and ignoring it would be a silent wrong answer.

Anything else is refused with a BodyError naming the field: the OpenAI fields in REFUSED (with the reason), and
unknown ones. A field set to null counts as absent (openai_body.present). /v1/responses has tables of its own
(RESPONSES_*, applied by router/openai_responses.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kimiserve.text import clip

# Honoured fields that are not OpenAI's: name -> where they come from and what they do.
EXTENSIONS: dict[str, str] = {
    "cache_salt": "vLLM's: a string (at most 256 characters) keying the prompt's prefix-cache entries; requests share "
                  "cached prefixes only under the same salt (GenerateRequest.cache_salt)",
    "top_k": "vLLM's: sample from the k most likely tokens only (SamplingParams.top_k)",
    "min_p": "vLLM's: in [0, 1], drop tokens less likely than min_p times the most likely (SamplingParams.min_p)",
    "repetition_penalty": "vLLM's: HF transformers' repetition penalty (SamplingParams.repetition_penalty)",
    "stop_token_ids": "vLLM's: token ids that end the sequence (SamplingParams.stop_token_ids)",
    "ignore_eos": "vLLM's: EOS does not end the sequence (SamplingParams.ignore_eos)",
    "min_tokens": "vLLM's: neither EOS, stop_token_ids nor a stop string ends the sequence before it has this many "
                  "tokens; at most max_tokens, not with response_format or a tool_choice that constrains the reply "
                  "(SamplingParams.min_tokens)",
    "include_stop_str_in_output": "vLLM's: the stop string that ended the text is kept at its end "
                                  "(SamplingParams.include_stop_str_in_output)",
    "structured_outputs": "vLLM's: one of json (a JSON Schema), regex, choice (the reply is exactly one of the "
                          "strings) or json_object: true, enforced by constrained decoding as response_format is "
                          "(SamplingParams.response_format; router/structured_outputs.py)",
    "guided_json": "vLLM's before 0.12: structured_outputs.json",
    "guided_regex": "vLLM's before 0.12: structured_outputs.regex",
    "guided_choice": "vLLM's before 0.12: structured_outputs.choice",
}

# Honoured on /v1/chat/completions only (completions and responses refuse them, as they render no chat turns):
# name -> where it comes from and what it does.
CHAT_EXTENSIONS: dict[str, str] = {
    "add_generation_prompt": "vLLM's: true (default) appends the assistant turn's header for the model to reply "
                             "after; false renders the conversation alone (ChatRequest.add_generation_prompt)",
    "continue_final_message": "vLLM's: the final message (assistant, text, no tool_calls) is rendered open and the "
                              "model continues it, a prefill; the reply is the new text only; not with "
                              "add_generation_prompt true (ChatRequest.continue_final_message)",
}

# Honoured on /v1/completions only (chat refuses them): name -> where it comes from and what it does.
COMPLETIONS_EXTENSIONS: dict[str, str] = {
    "prompt_logprobs": "vLLM's: 0-20; each choice also carries the prompt scored (first position null, then per "
                       "position the prompt token and that many alternatives by id with logprob, rank and "
                       "decoded_token); with max_tokens 0, the scored prompt alone",
}

# Honoured stream_options keys that are not OpenAI's (router/openai_body.STREAM_OPTIONS).
STREAM_OPTION_EXTENSIONS: dict[str, str] = {
    "continuous_usage_stats": "vLLM's: with stream, every chunk carries the usage so far (the prompt's tokens and "
                              "the completion tokens generated until that chunk)",
}

# name -> (the JSON type its value must have, why no value of it can change the reply)
IGNORED: dict[str, tuple[type, str]] = {
    "user": (str, "an end-user id for OpenAI's abuse monitoring"),
    "safety_identifier": (str, "the same, under its newer name"),
    "metadata": (dict, "tags of a stored completion; nothing is stored here"),
    "store": (bool, "storing the completion for OpenAI's evals and distillation; nothing is stored here"),
    "service_tier": (str, "OpenAI's processing tier; this server has one"),
    "prompt_cache_key": (str, "a routing hint for OpenAI's prompt cache; the router routes by prompt prefix itself"),
    "prompt_cache_retention": (str, "how long OpenAI keeps a cached prefix"),
    "prompt_cache_options": (dict, "the same, under its newer name"),
    "prediction": (dict, "predicted output only shortens the latency; the reply is the same"),
}

_TYPE_NAMES = {str: "a string", dict: "a JSON object", bool: "a boolean", int: "an integer"}

# name -> the values accepted (each changes nothing); compared by value and JSON type.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),  # candidates generated server-side per choice: one, the choice itself
    "parallel_tool_calls": (True,),  # /v1/completions has no tools (chat honours it)
    "modalities": (["text"],),  # text is all this server generates
    "verbosity": ("medium",),  # OpenAI's default; another level would change the reply
    "functions": ([],),  # the deprecated form of tools: send `tools`
    "function_call": ("auto", "none"),  # with no `functions`, either choice changes nothing
    "suffix": ("",),  # completions: text after the insertion point; none
}


# OpenAI fields that would change the reply and are not honoured: refused, with the reason in the message.
REFUSED: dict[str, str] = {
    "audio": "no audio output is generated",
    "reasoning_effort": "the model's reasoning cannot be steered",
    "web_search_options": "no web search is run",
    "moderation": "no moderation is run on input or output",
}


# /v1/responses: its own bookkeeping fields and its own refusals (router/openai_responses.py honours the rest).
RESPONSES_IGNORED: dict[str, tuple[type, str]] = {
    **{k: IGNORED[k] for k in ("user", "safety_identifier", "metadata", "service_tier", "prompt_cache_key",
                               "prompt_cache_retention", "prompt_cache_options")},
    "store": (bool, "keeping the response for later retrieval; nothing is stored here (the response says store: "
                    "false)"),
    "max_tool_calls": (int, "a cap on calls to OpenAI's built-in tools (web search, file search, ...); none are "
                            "offered here, and function calls are not counted against it"),
}

RESPONSES_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled",),  # OpenAI's default: a prompt over the context is refused, never cut
    "background": (False,),  # the response is computed while the request waits (or streams)
}

RESPONSES_REFUSED: dict[str, str] = {
    "previous_response_id": "responses are not stored here: send the conversation's items in input",
    "conversation": "conversations are not stored here: send the conversation's items in input",
    "prompt": "no stored prompt templates here",
    "reasoning": "the model's reasoning cannot be steered",
    "moderation": REFUSED["moderation"],
}


@dataclass(frozen=True)
class Rules:
    """One endpoint's fields beyond those it honours: accepted and ignored, accepted at no-op values, refused."""

    ignored: dict[str, tuple[type, str]]
    no_op_values: dict[str, tuple[Any, ...]]
    refused: dict[str, str]


CHAT_RULES = Rules(IGNORED, NO_OP_VALUES, REFUSED)  # /v1/chat/completions and /v1/completions
RESPONSES_RULES = Rules(RESPONSES_IGNORED, RESPONSES_NO_OP_VALUES, RESPONSES_REFUSED)


def describe(v: Any) -> str:
    """A client's value as an error message shows it: its JSON, cut to 60 characters."""
    text = json.dumps(v) if not isinstance(v, (bytes, set)) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class FieldError(ValueError):
    """A body field this server refuses; `field` names it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _same(a: Any, b: Any) -> bool:
    """JSON equality that tells true from 1 (Python's True == 1 would accept `best_of: true`)."""
    return type(a) is type(b) and a == b


def check(body: dict[str, Any], honoured: set[str], rules: Rules = CHAT_RULES) -> None:
    """Raises FieldError naming every refused field of `body` (the first, in sorted order, as `field`)."""
    refused: list[str] = []  # as the message shows them: the name, or name=value for a value refused
    reasons: list[str] = []
    for key in sorted(body):
        value = body[key]
        if key in honoured:
            continue
        if key in rules.ignored:
            kind, why = rules.ignored[key]
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise FieldError(f"{key} must be {_TYPE_NAMES[kind]}, got {type(value).__name__} (it is accepted "
                                 f"and ignored: {why})", key)
            continue
        if key in rules.no_op_values:
            if any(_same(value, ok) for ok in rules.no_op_values[key]):
                continue
            refused.append(f"{key}={clip(value)}")
            reasons.append(f"{key} is accepted only as {' or '.join(repr(v) for v in rules.no_op_values[key])}, as "
                           "any other value would change the reply")
            continue
        refused.append(clip(key, quote=False))
        if key in rules.refused:
            reasons.append(f"{key}: {rules.refused[key]}")
    if refused:
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        raise FieldError(f"unsupported body field(s) {refused}{detail}", refused[0].split("=")[0])

