"""vLLM's structured-output request fields -> SamplingParams.response_format, the constraint OpenAI's response_format
also becomes (enforced on the shard by constrained decoding, shard_svc/engine/grammar.py).

vLLM's `structured_outputs` object sets one of `json` (a JSON Schema, as an object or JSON text), `regex`, `choice`
(the reply is exactly one of the strings) or `json_object: true`; its names before vLLM 0.12, `guided_json`,
`guided_regex` and `guided_choice`, are taken as the same. A context-free `grammar`, `structural_tag` and the
options that retune vLLM's own grammar engines are refused by name (at their defaults, false or empty, they change
nothing and are accepted), as is a request that sets two constraints.
"""

from __future__ import annotations

import json
from typing import Any

from kimiserve.limits import JsonTooDeep, loads_json
from kimiserve.v1 import common_pb2
from router.openai_fields import FieldError, describe

FIELD = "structured_outputs"
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}  # vLLM < 0.12's names
KINDS = ("json", "regex", "choice", "json_object")
REFUSED = {
    "grammar": "context-free grammars are not offered: use json, regex or choice",
    "structural_tag": "structural tags are not offered: use json, regex or choice",
    "whitespace_pattern": "the JSON grammar's whitespace is the grammar engine's own",
    "disable_any_whitespace": "the JSON grammar's whitespace is the grammar engine's own",
    "disable_additional_properties": "a schema says additionalProperties itself",
    "disable_fallback": "there is one grammar engine, with no fallback to disable",
}
# What Rust's regex syntax (the shard's grammar engine) treats as meta characters: escaped in a choice's text.
_META = set("\\.+*?()|[]{}^$#&-~")


def apply(body: dict[str, Any], s: common_pb2.SamplingParams) -> None:
    """Sets s.response_format from the body's structured-output fields, if any (after OpenAI's response_format).
    FieldError names the body field at fault."""
    kind, value, name = _requested(body)
    if kind is None:
        return
    field = name.split(".")[0]
    if s.HasField("response_format"):
        raise FieldError(f"{name} and response_format both constrain the reply; set one of them", field)
    if kind == "json":
        s.response_format.json_schema.schema = json.dumps(_schema(value, name, field))
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise FieldError(f"{name} must be a non-empty string (a regular expression), got {describe(value)}",
                             field)
        s.response_format.regex = value
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise FieldError(f"{name} must be a non-empty list of strings, got {describe(value)}", field)
        s.response_format.regex = "(?:" + "|".join(choice_pattern(c) for c in value) + ")"
    elif value is True:
        s.response_format.json_object.SetInParent()
    else:
        raise FieldError(f"{name} must be true (false: leave it out), got {describe(value)}", field)


def choice_pattern(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in _META else c for c in text)


def _requested(body: dict[str, Any]) -> tuple[str | None, Any, str]:
    """(kind, its value, the field to name in errors) of the one constraint asked for; (None, None, "") if none."""
    asked: list[tuple[str, Any, str]] = [(kind, body[old], old) for old, kind in LEGACY.items() if old in body]
    if FIELD in body:
        spec = body[FIELD]
        if not isinstance(spec, dict):
            raise FieldError(f"{FIELD} must be a JSON object, got {describe(spec)}", FIELD)
        spec = {k: v for k, v in spec.items() if v is not None}  # null: unset, as at the top level
        for key in sorted(spec):
            if key in REFUSED and spec[key] in (False, "", {}, []):
                continue  # its default, as a client that sends every field of vLLM's params object sets it
            if key in REFUSED:
                raise FieldError(f"{FIELD}.{key} is not supported: {REFUSED[key]}", FIELD)
            if key not in KINDS:
                raise FieldError(f"{FIELD} may set one of {list(KINDS)}, got {key!r}", FIELD)
        asked += [(key, spec[key], f"{FIELD}.{key}") for key in KINDS if key in spec]
        if not asked:
            raise FieldError(f"{FIELD} must set one of {list(KINDS)}", FIELD)
    if len(asked) > 1:
        names = [name for *_, name in asked]
        raise FieldError(f"{' and '.join(names)} each constrain the reply; set one of them",
                        names[0].split(".")[0])
    return asked[0] if asked else (None, None, "")


def _schema(value: Any, name: str, field: str) -> dict[str, Any]:
    """A JSON Schema given as an object or as JSON text (its depth is checked with the rest of the request's)."""
    if isinstance(value, str):
        try:
            value = loads_json(value)
        except (json.JSONDecodeError, JsonTooDeep) as e:
            raise FieldError(f"{name} is not JSON: {e}", field) from None
    if not isinstance(value, dict):
        raise FieldError(f"{name} must be a JSON Schema object, got {describe(value)}", field)
    return value
