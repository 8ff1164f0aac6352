"""The one rule set for a sequence's sampling values and response_format, shared by the router and the shard.

The router applies it to a request's SamplingParams before anything is sent, so a client hears the field at fault at
once (`param`); the shard applies the same function to what it is submitted, since other gRPC callers than our
router can reach it. Each rule names its field, so either side can answer with it.

Values are passed by field name; a field left out is unset and not checked (the router passes only what the client
set; the shard passes its resolved values, whose defaults pass every rule).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import NamedTuple

from kimiserve.limits import (
    MAX_JSON_DEPTH, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_SCHEMA_NAME_CHARS,
    MAX_TEMPERATURE, MAX_TOP_LOGPROBS, JsonTooDeep, loads_json)
from kimiserve.seeds import SEED_BITS

SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]*")


class Problem(NamedTuple):
    param: str  # the SamplingParams field at fault
    message: str


def sampling_problems(values: Mapping[str, object]) -> list[Problem]:
    """Every problem of the sampling values given (field name -> value; a missing field is unset), in field order."""
    problems: list[Problem] = []

    def check(name: str, ok, rule: str) -> None:
        if name in values and not ok(values[name]):
            problems.append(Problem(name, f"{name} must be {rule}, got {values[name]}"))

    check("max_tokens", lambda v: v >= 1, ">= 1")
    if values.get("min_tokens", 0) and values.get("max_tokens") is not None:
        check("min_tokens", lambda v: v <= values["max_tokens"], f"<= max_tokens ({values['max_tokens']})")
    check("temperature", lambda v: 0 <= v <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE}]")
    check("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    check("top_k", lambda v: v >= 0, ">= 0")
    check("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        check(name, lambda v: -MAX_PENALTY <= v <= MAX_PENALTY, f"in [-{MAX_PENALTY}, {MAX_PENALTY}]")
    check("repetition_penalty", lambda v: 0 < v <= MAX_REPETITION_PENALTY, f"in (0, {MAX_REPETITION_PENALTY}]")
    top = values.get("top_logprobs", 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        problems.append(Problem("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}"))
    elif top and not values.get("logprobs", False):
        problems.append(Problem("top_logprobs", f"top_logprobs={top} needs logprobs"))
    if values.get("prompt_logprobs") is not None:
        check("prompt_logprobs", lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]")
    if values.get("seed") is not None:  # None: unset (the shard draws one); the wire's uint64 always passes
        check("seed", lambda v: 0 <= v < 1 << SEED_BITS, f"in [0, 2^{SEED_BITS}) (a uint64)")
    problems += logit_bias_problems(values.get("logit_bias", {}))
    return problems


def logit_bias_problems(bias: Mapping[int, float]) -> list[Problem]:
    """At most MAX_LOGIT_BIAS_TOKENS entries, each value in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (NaN is outside);
    the ids are checked against the vocabulary by token_id_problems, where it is known."""
    problems = []
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        problems.append(Problem("logit_bias", f"logit_bias has {len(bias)} entries; at most "
                                              f"{MAX_LOGIT_BIAS_TOKENS} are allowed"))
    bad = {t: v for t, v in bias.items() if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
    if bad:
        first = dict(list(bad.items())[:4])
        problems.append(Problem("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                              f"{MAX_LOGIT_BIAS:g}], got {first}"))
    return problems


def response_format_problems(kind: str | None, ignore_eos: bool, schema_name: str = "", schema: str = "",
                             regex: str = "", min_tokens: int = 0) -> list[Problem]:
    """What needs no vocabulary: the shard compiles the grammar and refuses what its grammar engine cannot enforce.
    `kind`: the ResponseFormat's set kind (None: a ResponseFormat with none set)."""
    if kind is None:
        return [Problem("response_format", "response_format must set json_object, json_schema or regex")]
    problems = [Problem("response_format", f"{name} cannot be combined with response_format: the format decides "
                                           f"where the output ends")
                for name, on in (("ignore_eos", ignore_eos), ("min_tokens", min_tokens > 0)) if on]
    if kind == "json_schema":  # its size was checked with the request's other sizes (kimiserve/limits.py)
        if len(schema_name) > MAX_SCHEMA_NAME_CHARS or not SCHEMA_NAME.fullmatch(schema_name):
            problems.append(Problem("response_format", f"response_format json_schema.name must match "
                                    f"[A-Za-z0-9_-]{{0,{MAX_SCHEMA_NAME_CHARS}}}, got {schema_name[:80]!r}"))
        try:
            parsed = loads_json(schema)
        except (json.JSONDecodeError, JsonTooDeep) as e:
            problems.append(Problem("response_format", f"response_format json_schema.schema is not JSON of at most "
                                                       f"{MAX_JSON_DEPTH} levels: {e}"))
        else:
            if not isinstance(parsed, dict):
                problems.append(Problem("response_format", f"response_format json_schema.schema must be a JSON "
                                                           f"object, got {type(parsed).__name__}"))
    elif kind == "regex" and not regex:
        problems.append(Problem("response_format", "response_format regex is empty"))
    return problems


def token_id_problems(param: str, ids: list[int] | tuple[int, ...], vocab_size: int) -> list[Problem]:
    """Token ids (the prompt's, or stop_token_ids) must lie in the vocabulary [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not bad:
        return []
    return [Problem(param, f"{param}: {len(bad)} token ids outside [0, vocab size {vocab_size}), first: {bad[:8]}")]


def describe(problems: list[Problem]) -> tuple[str, str]:
    """(one message naming every problem, the first field at fault)."""
    return "; ".join(p.message for p in problems), problems[0].param
