"""The one rule for vLLM's continue_final_message / add_generation_prompt, shared by the router and the tokenizer
service.

The router applies it before it asks for a rendering, so a client hears the field at fault (`param`) at once; the
tokenizer service applies it again to every RenderChat, since other gRPC callers than our router can reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kimiserve.text import clip

CONTINUE = "continue_final_message"
ADD_GENERATION_PROMPT = "add_generation_prompt"


class Message(Protocol):
    """What the rule reads of a message: common_pb2.ChatMessage and the tokenizer's ChatMessage both fit."""

    role: str

    @property
    def tool_calls(self) -> Sequence[object]:
        ...


class ContinuationError(ValueError):
    """The flags or the final message do not allow continuing; `field` is the request field at fault."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    """Whether the assistant header is appended: `add_generation_prompt` when set (None: unset), else the opposite of
    `continue_final_message`. Both true is refused, as vLLM refuses it: the open turn and a new one cannot both end
    the prompt."""
    if continue_final_message and add_generation_prompt:
        raise ContinuationError(f"{ADD_GENERATION_PROMPT}: true cannot be combined with {CONTINUE}: true (the final "
                                "message is continued, so no new assistant turn is opened); leave it unset or false",
                                ADD_GENERATION_PROMPT)
    return not continue_final_message if add_generation_prompt is None else add_generation_prompt


def check_final_message(messages: Sequence[Message]) -> None:
    """The final message of a conversation to continue must be the assistant's own text: a turn of another role is
    not the model's to continue, and one with tool calls ends in a closed tool-calls section."""
    if not messages:
        return  # an empty conversation is refused by name where the messages are checked
    last, index = messages[-1], len(messages) - 1
    if last.role != "assistant":
        raise ContinuationError(f"{CONTINUE}: the final message (messages[{index}]) has role {clip(last.role)}; only "
                                "an assistant message can be continued", CONTINUE)
    if last.tool_calls:
        raise ContinuationError(f"{CONTINUE}: the final message (messages[{index}]) has tool_calls; only an "
                                "assistant message of text alone can be continued", CONTINUE)
