"""Triton's CPU interpreter, minus one repeated cost.

A kernel launch (GridExecutor) patches triton.language for the interpreter and restores it when the grid is done.
Every call of a @triton.jit function from inside the kernel (InterpretedFunction.__call__: our helpers, and Triton's
own tl.sum, tl.cdiv, ...) patches the language modules its globals see once more, ~2 ms a call (inspect.getmembers
over each), and Triton never restores that patch. Where the launch around the call has patched those modules, or an
earlier such call did and no launch has restored them since, the repeat finds nothing left to patch and sets
attributes to what they already do. Here the repeat is skipped; every other call takes Triton's own path.

Written against the Triton pinned in constraints.txt; with another version `install` leaves the interpreter as it
is and warns, so the tests only run slower.
"""

from __future__ import annotations

import inspect
import warnings

PINNED = "3.9.0"
_launch_langs: list[frozenset[int]] = []  # per launch in progress: ids of the language modules it patched
_left_patched: set[int] = set()  # modules a helper call patched (never restored) and no launch has touched since


def _langs(fn) -> frozenset[int]:
    """The modules the interpreter patches for `fn` (its globals' triton.language and triton.language.core)."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> None:
    """Patches the interpreter of the Triton imported now (call after importing it with TRITON_INTERPRET=1)."""
    import triton
    from triton.runtime import interpreter

    if triton.__version__ != PINNED:
        warnings.warn(f"tests/kernels/interpreter_speed.py is written for Triton {PINNED}, found "
                      f"{triton.__version__}: the interpreter keeps re-patching per helper call (slower tests)")
        return
    if getattr(interpreter.GridExecutor.__call__, "_kimiserve", False):
        return
    launch = interpreter.GridExecutor.__call__

    def launch_call(self, *args, **kwargs):
        _launch_langs.append(_langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _left_patched.difference_update(_launch_langs.pop())  # its restore may have undone some of theirs

    def helper_call(self, *args, **kwargs):
        langs = _langs(self.fn)
        if not _launch_langs or not langs <= _launch_langs[-1] | _left_patched:
            interpreter._patch_lang(self.fn)
            _left_patched.update(langs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    launch_call._kimiserve = True
    interpreter.GridExecutor.__call__ = launch_call
    interpreter.InterpretedFunction.__call__ = helper_call
