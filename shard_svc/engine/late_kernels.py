"""Triton kernels first met after the warm-up, named and counted.

The warm-up (engine/warmup.py) runs every kind of pass before a shard reports SERVING, so that no user waits for the
compiler. A kernel variant it missed (a new specialization: another M-block, another length class) is compiled when
a request first needs it: 0.5-1.4 s on the 48B shape, with every other request of the pass waiting behind it
(README, multi-turn replay on the H200). Triton calls `knobs.runtime.jit_cache_hook` whenever a kernel variant is not
yet in the process's memory (compiled, or loaded from the on-disk cache); after the warm-up each such call is logged
with the kernel's name and specialization and counted in `kimiserve_shard_kernels_after_warmup_total`, so a gap in
the warm-up shows in production and in every benchmark run.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)


class LateKernels:
    """Watches Triton's kernel cache misses: ignored until `watch()` (the warm-up's own), then each one logged and
    reported to `on_late()`."""

    def __init__(self, on_late: Callable[[], None]):
        self._on_late = on_late
        self._watching = False
        self._previous: Callable | None = None

    def install(self) -> bool:
        """Chains this ahead of any hook already set (another library's); False, logged, where this Triton has no
        such hook (the shard serves on, unwatched)."""
        try:
            from triton import knobs

            self._previous = knobs.runtime.jit_cache_hook
        except (ImportError, AttributeError) as e:
            log.warning("cannot watch for kernels met after the warm-up: this Triton has no jit_cache_hook",
                        extra={"error": repr(e)})
            return False
        knobs.runtime.jit_cache_hook = self.hook
        return True

    def watch(self) -> None:
        self._watching = True

    def hook(self, *, fn, repr: str, **kwargs):  # noqa: A002 - Triton's keyword
        """Triton's jit_cache_hook: a true return would skip the compile, so this returns the chained hook's answer
        (None without one)."""
        if self._watching:
            name = getattr(fn, "name", str(fn))
            log.warning("kernel first met after the warm-up: a request waited for it to compile or load",
                        extra={"kernel": name, "specialization": repr})
            self._on_late()
        if self._previous is not None:
            return self._previous(fn=fn, repr=repr, **kwargs)
        return None
