"""Stop strings over a stream of text deltas: text is cut before the first stop string (after it, with
`include`: vLLM's include_stop_str_in_output), and nothing that could still turn out to be the start of a stop
string is emitted early. The first stop string is the one that is complete first (earliest end; of two ending
together, the longer), so how the text was split into deltas never changes which one it is. Text fed unarmed (the
tokens before vLLM's min_tokens) cannot end a stop string, though one may begin in it."""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buffer = ""
        self._emitted = 0  # text passed on (or cut) before the buffer
        self._unarmed = 0  # the length of the text fed unarmed: a stop string must end after it
        self.stopped = False

    def feed(self, delta: str, armed: bool = True) -> str:
        """Returns the text that is safe to emit now; sets `stopped` once a stop string has appeared."""
        if self.stopped:
            return ""
        self._buffer += delta
        if not armed:
            self._unarmed = self._emitted + len(self._buffer)
        first = self._unarmed - self._emitted  # a stop string must end after buffer index first - 1
        found = ((s, self._buffer.find(s, max(0, first - len(s) + 1))) for s in self.stops)
        hits = [(at + len(s), at, s) for s, at in found if at >= 0]
        if hits:
            _, at, stop = min(hits)
            self.stopped = True
            out, self._buffer = self._buffer[:at] + (stop if self.include else ""), ""
            return out
        cut = max(0, len(self._buffer) - self._hold)
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        self._emitted += cut
        return out

    def flush(self) -> str:
        """At the end of generation the held-back tail can no longer start a stop string."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
