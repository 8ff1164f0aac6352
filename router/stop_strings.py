"""Stop strings over a stream of text deltas: text is cut before the first stop string (after it, with
`include`: vLLM's include_stop_str_in_output), and nothing that could still turn out to be the start of a stop
string is emitted early. The first stop string is the one that is complete first (earliest end; of two ending
together, the longer), so how the text was split into deltas never changes which one it is."""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Returns the text that is safe to emit now; sets `stopped` once a stop string has appeared."""
        if self.stopped:
            return ""
        self._buffer += delta
        hits = [(at + len(s), at, s) for s, at in ((s, self._buffer.find(s)) for s in self.stops) if at >= 0]
        if hits:
            _, at, stop = min(hits)
            self.stopped = True
            out, self._buffer = self._buffer[:at] + (stop if self.include else ""), ""
            return out
        cut = max(0, len(self._buffer) - self._hold)
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out

    def flush(self) -> str:
        """At the end of generation the held-back tail can no longer start a stop string."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
