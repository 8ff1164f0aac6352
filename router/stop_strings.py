"""Stop strings over a stream of text deltas: text is cut before the first stop string, and nothing that could
still turn out to be the start of a stop string is emitted early."""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Returns the text that is safe to emit now; sets `stopped` once a stop string has appeared."""
        if self.stopped:
            return ""
        self._buffer += delta
        hits = [i for i in (self._buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._buffer = self._buffer[: min(hits)], ""
            return out
        cut = max(0, len(self._buffer) - self._hold)
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out

    def flush(self) -> str:
        """At the end of generation the held-back tail can no longer start a stop string."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
