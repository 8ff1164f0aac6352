"""Structured output by constrained decoding: a request's response_format compiled into a matcher over the
checkpoint's vocabulary, each step's allowed-token bitmask, and that mask applied to logits on the device.

The grammar engine is llguidance (MIT; a 3 MB wheel with no dependencies; runs on the CPU next to any device; a
mask for a 160k vocabulary takes tens of microseconds; JSON Schema, regex and Lark grammars). Its vocabulary is the
checkpoint's own tokenizer as tokenizer_svc loads it: `tokenizer.json`, or Kimi's `tiktoken.model`, which the loader
turns into the equivalent HF byte-level BPE, so both formats reach llguidance the same way. Masks are computed on
the host (that is where the matcher lives) for all constrained rows of a pass at once, copied to the device in
one transfer, and unpacked there; the matcher then advances with the sampled token on the host.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from kimiserve.kimi_chat import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, THINK_BEGIN, THINK_END
from kimiserve.limits import (
    MAX_JSON_DEPTH, MAX_RESPONSE_FORMAT_BYTES, MAX_TOOL_CALLS, MAX_TOOLS, MAX_TOOLS_BYTES,
    JsonTooDeep, loads_json)
from kimiserve.tokenizer_files.loading import TIKTOKEN_MODEL, TOKENIZER_JSON, load_tokenizer
from shard_svc.errors import InvalidRequest

log = logging.getLogger(__name__)

RESPONSE_FORMAT_KINDS = ("json_object", "json_schema", "regex", "tool_calls")
# JSON is generated compact (", " and ": " between items, no other whitespace) unless a schema's own "x-guidance"
# says otherwise: with free whitespace a model can spend its whole max_tokens on spaces and newlines between two
# keys (a random or weak model does), and one canonical form keeps replies short and comparable.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _refused(message: str) -> InvalidRequest:
    """Every refusal here blames the request's response_format (the router answers HTTP clients with that param)."""
    return InvalidRequest(message, "response_format")


@dataclass(frozen=True)
class ResponseFormat:
    """What a constrained sequence must produce (the proto's ResponseFormat)."""

    kind: str  # one of RESPONSE_FORMAT_KINDS
    text: str = ""  # json_schema: the schema as JSON text; regex: the expression; json_object: unused
    name: str = ""  # json_schema: the schema's name (logged only)
    # tool_calls: (name, parameters JSON schema text, "" for any object) of each function that may be called
    functions: tuple[tuple[str, str], ...] = ()
    max_calls: int = 0  # tool_calls: most calls in the section (1..MAX_TOOL_CALLS)
    text_first: bool = False  # tool_calls: free text (after an optional <think> block) first, the section optional

    def validate(self) -> None:
        """The checks that need no tokenizer beyond kimiserve/sampling_rules.py's (the schema's name, that a schema
        is a JSON object and a regex not empty: SamplingParams.validate runs those); Grammars.compile checks the
        grammar itself."""
        if self.kind not in RESPONSE_FORMAT_KINDS:
            raise _refused(f"response_format kind must be one of {RESPONSE_FORMAT_KINDS}, got {self.kind!r}")
        if self.kind == "tool_calls":
            _validate_tool_calls(self.functions, self.max_calls)
        if (size := len(self.text.encode("utf-8"))) > MAX_RESPONSE_FORMAT_BYTES:
            raise _refused(f"response_format {self.kind}: {size:,} bytes is over the limit of "
                           f"{MAX_RESPONSE_FORMAT_BYTES:,}")


def _validate_tool_calls(functions: tuple[tuple[str, str], ...], max_calls: int) -> None:
    if not 1 <= len(functions) <= MAX_TOOLS:
        raise _refused(f"response_format tool_calls: {len(functions)} functions; 1 to {MAX_TOOLS} allowed")
    if (size := sum(len(n.encode("utf-8")) + len(p.encode("utf-8")) for n, p in functions)) > MAX_TOOLS_BYTES:
        raise _refused(f"response_format tool_calls: {size:,} bytes of names and parameters is over the limit "
                       f"of {MAX_TOOLS_BYTES:,}")
    if not 1 <= max_calls <= MAX_TOOL_CALLS:
        raise _refused(f"response_format tool_calls: max_calls must be in [1, {MAX_TOOL_CALLS}], got "
                       f"{max_calls}")
    names = [n for n, _ in functions]
    if "" in names or len(set(names)) != len(names):
        raise _refused(f"response_format tool_calls: function names must be non-empty and unique, got {names}")
    for name, parameters in functions:
        if parameters:
            _object_schema(parameters, f"tool_calls: function {name!r} parameters")


def _object_schema(text: str, field: str) -> dict:
    """The JSON schema in `text`, which must be an object; `field` names it in the error."""
    try:
        schema = loads_json(text)
    except (json.JSONDecodeError, JsonTooDeep) as e:
        raise _refused(f"response_format {field}: not JSON of at most {MAX_JSON_DEPTH} levels: {e}") from e
    if not isinstance(schema, dict):
        raise _refused(f"response_format {field}: must be a JSON object schema, got {type(schema).__name__}")
    return schema


def tool_calls_grammar(functions: tuple[tuple[str, str], ...], max_calls: int, text_first: bool = False) -> str:
    """A Lark grammar (llguidance's dialect) of Kimi's tool-calls section with 1..max_calls calls:

        <|tool_calls_section_begin|> call_0 [call_1 [... call_{max_calls-1}]] <|tool_calls_section_end|>
        call_i: <|tool_call_begin|> "functions.NAME:i" <|tool_call_argument_begin|> args_NAME <|tool_call_end|>

    for every NAME of `functions`, args_NAME being JSON valid under its parameters schema (%json). Each <|...|> is
    the special token itself, never its text spelled out in ordinary tokens. The call index is in the id, so each
    position gets its own rule; names and schemas are quoted as JSON strings, so any name is a literal.

    text_first: the reply may first think (<think> ... </think>) and write text, and the section is optional. Text
    is any run of ordinary tokens: llguidance gives special tokens bytes no text expression matches, so the text
    ends exactly where a special token (the section, the end of turn) comes."""
    if text_first:
        lines = ["start: think? TEXT section?", f"think: {THINK_BEGIN} TEXT {THINK_END}", "TEXT: /(?s:.*)/",
                 f"section: {SECTION_BEGIN} calls_0 {SECTION_END}"]
    else:
        lines = [f"start: {SECTION_BEGIN} calls_0 {SECTION_END}"]
    for i in range(max_calls):
        more = f" calls_{i + 1}?" if i + 1 < max_calls else ""
        lines.append(f"calls_{i}: call_{i}{more}")
        alternatives = " | ".join(f"{json.dumps(f'functions.{name}:{i}')} {ARG_BEGIN} args_{k}"
                                  for k, (name, _) in enumerate(functions))
        lines.append(f"call_{i}: {CALL_BEGIN} ({alternatives}) {CALL_END}")
    for k, (_, parameters) in enumerate(functions):
        schema = loads_json(parameters) if parameters else {}
        lines.append(f"args_{k}: %json {json.dumps({'type': 'object', 'x-guidance': JSON_OPTIONS, **schema})}")
    return "\n".join(lines) + "\n"


class Grammars:
    """Compiles response formats against one checkpoint's vocabulary and computes the masks of a pass."""

    def __init__(self, tokenizer: llguidance.LLTokenizer | None, vocab_size: int, refusal: str | None = None):
        """refusal: why no grammar can be enforced with this checkpoint (tokenizer None); every response_format
        request is then refused with it, and the shard serves everything else."""
        if (tokenizer is None) == (refusal is None):
            raise ValueError("Grammars needs a tokenizer or a refusal reason, not both or neither")
        self.tokenizer, self.vocab_size, self.refusal = tokenizer, vocab_size, refusal
        self._executor = llguidance.LLExecutor()

    @classmethod
    def for_checkpoint(cls, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Grammars | None:
        """From the tokenizer in `model_dir`; None when the checkpoint has no tokenizer (structured output is then
        refused per request, naming the missing files). The model's EOS ids are what a complete text may end
        with."""
        if not any((Path(model_dir) / f).is_file() for f in (TOKENIZER_JSON, TIKTOKEN_MODEL)):
            log.info("no tokenizer in the checkpoint; response_format will be refused",
                     extra={"model_dir": str(model_dir)})
            return None
        start = time.perf_counter()
        loaded = load_tokenizer(Path(model_dir))
        # llguidance ends a grammar on an end-of-sequence id of the tokenizer's own vocabulary; a config.json eos id
        # past it (a benchmark's full-size config beside a tiny tokenizer) cannot be one.
        covered = [e for e in eos_token_ids if e < loaded.vocab_size]
        outside = [e for e in eos_token_ids if e >= loaded.vocab_size]
        where = f"{model_dir} ({loaded.source}, {loaded.vocab_size} ids; config.json vocab_size {vocab_size})"
        tokenizer, refusal = None, None
        if loaded.vocab_size > vocab_size:
            refusal = f"{where}: the tokenizer has more ids than the model"
        elif not covered:
            refusal = (f"{where}: config.json's eos_token_id {list(eos_token_ids)} is outside the tokenizer's ids, "
                       "so no constrained output could end")
        else:
            try:
                tokenizer = llguidance.LLTokenizer(loaded.hf.to_str(), n_vocab=vocab_size, eos_token=covered)
            except ValueError as e:  # llguidance's own checks of the vocabulary: refused per request, named
                refusal = f"{where}: the grammar engine refused the vocabulary: {e}"
        if refusal is not None:
            log.warning("structured output off: response_format requests will be refused", extra={"reason": refusal})
            return cls(None, vocab_size, refusal)
        if outside:
            log.warning("structured output ends only on the eos ids the tokenizer holds",
                        extra={"model_dir": str(model_dir), "eos_used": covered, "eos_outside_tokenizer": outside,
                               "tokenizer_ids": loaded.vocab_size})
        log.info("structured output ready", extra={"model_dir": str(model_dir), "source": loaded.source,
                                                   "vocab_size": vocab_size, "eos_token_ids": covered,
                                                   "load_s": round(time.perf_counter() - start, 3)})
        return cls(tokenizer, vocab_size)

    def compile(self, fmt: ResponseFormat, request_id: str) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence. Raises InvalidRequest naming what the grammar engine refused."""
        if self.refusal is not None:
            raise _refused(f"request {request_id!r}: response_format cannot be enforced by this shard: "
                           f"{self.refusal}")
        fmt.validate()
        if fmt.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(fmt.text)
        elif fmt.kind == "tool_calls":
            grammar = llguidance.LLMatcher.grammar_from_lark(tool_calls_grammar(fmt.functions, fmt.max_calls,
                                                                                fmt.text_first))
        else:
            schema = json.loads(fmt.text) if fmt.kind == "json_schema" else {"type": "object"}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error or messages:  # a warning is a keyword it would not enforce: refused, never ignored
            raise _refused(f"request {request_id!r}: response_format {fmt.kind} cannot be enforced: "
                           + "; ".join(messages))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise _refused(f"request {request_id!r}: response_format {fmt.kind}: {matcher.get_error()}")
        return matcher

    def masks(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """The allowed-token bitmasks of the matchers' next step, int32 [len(matchers), words] on the host (bit
        t % 32 of word t // 32 set: token t allowed), computed in parallel threads."""
        words = (self.vocab_size + 31) // 32  # one bit per id, rounded up to whole words
        out = torch.zeros(len(matchers), words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.data_ptr(),
                                               words * 4, len(matchers))
        return out


def apply_allowed(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] with -inf wherever the row's bitmask (int32 [rows, words], on logits' device) has the
    token's bit clear."""
    vocab = logits.shape[-1]
    if bits.shape[-1] * 32 < vocab:
        raise ValueError(f"bitmask of {bits.shape[-1]} words covers {bits.shape[-1] * 32} ids, vocab is {vocab}")
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
