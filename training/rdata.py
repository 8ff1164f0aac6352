"""Read character vectors out of an R package's lazy-load data (`data/Rdata.rdx` + `data/Rdata.rdb`).

The corpus (corpus.py) ships inside Debian's r-cran-janeaustenr as R's serialization format, version 2 or 3 in XDR
(big-endian) form. Only what that data holds is understood: character vectors, the integer/real/logical vectors and
named lists of the index, symbols and their back-references, pairlists of attributes. Anything else is refused with
the type code, rather than skipped.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from typing import Any

NILVALUE, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, REFSXP = (
    254, 1, 2, 9, 10, 13, 14, 16, 19, 255)
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10


class RDataError(ValueError):
    """The bytes are not R serialization this reader understands."""


class _Reader:
    def __init__(self, data: bytes, source: str):
        self.data, self.pos, self.source = data, 0, source
        self.symbols: list[Any] = []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RDataError(f"{self.source}: truncated at byte {self.pos} (wanted {n} more)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def item(self) -> Any:
        flags = self.int()
        kind = flags & 0xFF
        if kind == NILVALUE:
            return None
        if kind == REFSXP:
            return self.symbols[(flags >> 8) - 1]
        if kind == SYMSXP:
            name = self.item()
            self.symbols.append(name)
            return name
        if kind == CHARSXP:
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8")
        if kind == LISTSXP:  # attributes: [(tag, value), ...]
            if flags & HAS_ATTR:
                self.item()
            tag = self.item() if flags & HAS_TAG else None
            value = self.item()
            rest = self.item()
            return [(tag, value)] + (rest or [])
        if kind in (STRSXP, VECSXP):
            value: Any = [self.item() for _ in range(self.int())]
        elif kind in (INTSXP, LGLSXP):
            n = self.int()
            value = list(struct.unpack(f">{n}i", self.take(4 * n)))
        elif kind == REALSXP:
            n = self.int()
            value = list(struct.unpack(f">{n}d", self.take(8 * n)))
        else:
            raise RDataError(f"{self.source}: R type {kind} at byte {self.pos - 4} is not understood")
        if flags & HAS_ATTR:
            attrs = dict(self.item() or [])
            if "names" in attrs:
                return dict(zip(attrs["names"], value))
        return value


def unserialize(data: bytes, source: str = "R data") -> Any:
    """One serialized R object: character vectors -> list[str | None], named lists -> dict, vectors -> list."""
    r = _Reader(data, source)
    if r.take(2) != b"X\n":
        raise RDataError(f"{source}: not XDR R serialization (header {data[:2]!r})")
    version = r.int()
    r.int(), r.int()  # writer's R version, minimal reader version
    if version == 3:
        r.take(r.int())  # native encoding name
    elif version != 2:
        raise RDataError(f"{source}: serialization version {version} (known: 2, 3)")
    return r.item()


def read_lazy_load(rdx: bytes, rdb: bytes, source: str) -> dict[str, Any]:
    """Every object of a lazy-load database (`Rdata.rdb` bytes), by name, as listed by its index (`Rdata.rdx`)."""
    index = unserialize(gzip.decompress(rdx), f"{source}/Rdata.rdx")
    objects = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[int(offset):int(offset) + int(length)]
        size = struct.unpack(">I", blob[:4])[0]
        raw = zlib.decompress(blob[4:])
        if len(raw) != size:
            raise RDataError(f"{source}/Rdata.rdb: {name}: {len(raw)} bytes inflated, header says {size}")
        objects[name] = unserialize(raw, f"{source}/Rdata.rdb:{name}")
    return objects
