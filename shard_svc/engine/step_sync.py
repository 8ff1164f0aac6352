"""The points where an engine must agree with the other engines it steps with, and the one-process answer: nothing.

`Engine` calls its `StepSync` when a request is added or cancelled, around each step and for each draw. One process
steps alone (`ALONE`: every call a no-op, `draw` samples here). A shard group's ranks step in lockstep through
shard_svc/parallel/sync.py's StepSync, which the group's loader hands to the engine; the engine never knows how.
"""

from __future__ import annotations

from typing import Callable, Protocol

from shard_svc.engine.sampling import Drawn


class StepSync(Protocol):
    kda_heads: int | None  # the KDA heads this process's pools hold (None: all of the model's)

    @property
    def world(self) -> int:
        """How many engines step together (1: this one alone)."""

    def on_add(self, request_id: str, prompt: list[int], params, keep_prompt_logits: bool, prefix,
               prior_output: int) -> None: ...

    def on_cancel(self, request_id: str) -> None: ...

    def begin_step(self) -> None: ...

    def check_plan(self, plan) -> None: ...

    def draw(self, n: int, sample: Callable[[], list[Drawn]]) -> list[Drawn]:
        """The n draws of a pass; `sample()` draws them here."""

    def end_step(self, engine, result) -> None: ...


class Alone:
    """One engine stepping by itself: nothing to send, compare or wait for."""

    kda_heads: int | None = None
    world = 1

    def on_add(self, request_id: str, prompt: list[int], params, keep_prompt_logits: bool, prefix,
               prior_output: int) -> None:
        pass

    def on_cancel(self, request_id: str) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def check_plan(self, plan) -> None:
        pass

    def draw(self, n: int, sample: Callable[[], list[Drawn]]) -> list[Drawn]:
        return sample()

    def end_step(self, engine, result) -> None:
        pass


ALONE = Alone()
