"""The training corpus: Jane Austen's six novels, from Debian's `r-cran-janeaustenr` package.

The novels (1811-1818) are in the public domain; the package is MIT-licensed (Julia Silge) and ships them as R data.
`python3 -m training.corpus --deb r-cran-janeaustenr_1.0.0-1_all.deb` (from `apt-get download r-cran-janeaustenr`)
derives `training/data/austen.txt` from the .deb alone, byte for byte the same every time: each novel from its first
chapter heading to its end, headings, end marks and scene breaks dropped, each paragraph's lines joined by spaces,
`_emphasis_` marks removed.
Novels are separated by a form feed line; paragraphs by one blank line. Training reads only the derived file, so
nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import lzma
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from kimiserve.logs import setup_logging
from training.rdata import read_lazy_load

log = logging.getLogger(__name__)

CORPUS_FILE = Path(__file__).parent / "data" / "austen.txt"
PACKAGE_DATA = "./usr/lib/R/site-library/janeaustenr/data/"
# R object name -> title, in order of publication.
NOVELS = {
    "sensesensibility": "Sense and Sensibility", "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
NOVEL_SEPARATOR = "\n\f\n"
# Chapter and volume headings, end marks, and scene breaks of asterisks: not prose.
_HEADING = re.compile(r"^(CHAPTER|Chapter|VOLUME) [0-9IVXLC]+\.?$|^(THE END|FINIS|Finis)$|^[* ]+$")


class CorpusError(RuntimeError):
    """The package or the derived corpus file is not what this module expects."""


def _ar_member(deb: bytes, wanted_prefix: str, source: str) -> tuple[str, bytes]:
    """The first member of a Debian `ar` archive whose name starts with `wanted_prefix`."""
    if not deb.startswith(b"!<arch>\n"):
        raise CorpusError(f"{source}: not an ar archive (a .deb)")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos:pos + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        if name.startswith(wanted_prefix):
            return name, deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    raise CorpusError(f"{source}: no member named {wanted_prefix}* in the .deb")


def novels_from_deb(deb_path: Path) -> dict[str, list[str]]:
    """R object name -> the novel's lines, read from the package's lazy-load data inside the .deb."""
    deb = deb_path.read_bytes()
    name, data = _ar_member(deb, "data.tar", str(deb_path))
    if not name.endswith(".xz"):
        raise CorpusError(f"{deb_path}: {name}: only an xz-compressed data.tar is read")
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()
                 if m.isfile() and m.name.startswith(PACKAGE_DATA)}
    try:
        rdx, rdb = files[PACKAGE_DATA + "Rdata.rdx"], files[PACKAGE_DATA + "Rdata.rdb"]
    except KeyError as e:
        raise CorpusError(f"{deb_path}: {e.args[0]} missing; is this r-cran-janeaustenr?") from e
    objects = read_lazy_load(rdx, rdb, f"{deb_path}:{PACKAGE_DATA}")
    missing = sorted(set(NOVELS) - set(objects))
    if missing:
        raise CorpusError(f"{deb_path}: novels {missing} missing (found {sorted(objects)})")
    return {name: objects[name] for name in NOVELS}


def clean_novel(lines: list[str | None], name: str) -> list[str]:
    """Paragraphs of prose: from the first chapter heading on, headings dropped, emphasis marks removed."""
    start = next((i for i, line in enumerate(lines) if line and _HEADING.match(line.strip())), None)
    if start is None:
        raise CorpusError(f"{name}: no chapter heading found")
    paragraphs, current = [], []
    for line in [*lines[start:], ""]:
        text = (line or "").strip()
        if text:
            current.append(text)
            continue
        if current:
            paragraph = " ".join(current).replace("_", "")
            if not _HEADING.match(paragraph):
                paragraphs.append(re.sub(r"\s+", " ", paragraph))
            current = []
    return paragraphs


def derive_corpus(deb_path: Path) -> str:
    novels = novels_from_deb(deb_path)
    return NOVEL_SEPARATOR.join("\n\n".join(clean_novel(lines, name)) for name, lines in novels.items()) + "\n"


@dataclass(frozen=True)
class Corpus:
    """Paragraphs, split into training and held-out parts (the last `held_out` fraction of each novel)."""

    train_by_novel: dict[str, list[str]]  # title -> its training paragraphs
    held_out: list[str]

    @property
    def train(self) -> list[str]:
        return [p for paragraphs in self.train_by_novel.values() for p in paragraphs]


def load_corpus(path: Path = CORPUS_FILE, held_out: float = 0.05) -> Corpus:
    if not path.is_file():
        raise CorpusError(f"{path} not found; derive it with `python3 -m training.corpus --deb ...`")
    novels = path.read_text(encoding="utf-8").split(NOVEL_SEPARATOR)
    if len(novels) != len(NOVELS):
        raise CorpusError(f"{path}: {len(novels)} novels, expected {len(NOVELS)}")
    train, test = {}, []
    for title, novel in zip(NOVELS.values(), novels):
        paragraphs = novel.strip("\n").split("\n\n")
        cut = len(paragraphs) - max(1, round(held_out * len(paragraphs)))
        train[title] = paragraphs[:cut]
        test += paragraphs[cut:]
    return Corpus(train, test)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m training.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deb", required=True, type=Path, help="r-cran-janeaustenr_*.deb (apt-get download)")
    parser.add_argument("--out", type=Path, default=CORPUS_FILE)
    args = parser.parse_args(argv)
    setup_logging("training.corpus")
    text = derive_corpus(args.deb)
    args.out.write_text(text, encoding="utf-8")
    log.info("corpus written", extra={"out": str(args.out), "chars": len(text),
                                      "deb_sha256": hashlib.sha256(args.deb.read_bytes()).hexdigest(),
                                      "sha256": hashlib.sha256(text.encode()).hexdigest()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
