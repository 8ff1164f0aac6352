"""The tokenizer service keeps nothing of the texts it encodes (issue 33).

`tokenizers`' BPE model caches every distinct word it encodes (up to 10,000, each as big as the word: ~10 KB for a
long one), so a soak whose prompts held new long words raised the service's RSS by tens of MiB. The service turns
that cache off (tokenizer_svc/server.py keep_no_words). Measured here as the bytes malloc holds for live allocations
(glibc's mallinfo2) around encoding 3,000 distinct 200-letter words in a fresh single-threaded process: the same
allocations on every run, so the count is exact, not a sample of RSS; with the cache they hold ~20 MiB.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HELD_LIMIT_BYTES = 1 << 20  # what may stay allocated after the encodes: far below one cached word per ~100 words

SCRIPT = """
import ctypes, random, sys
from pathlib import Path
from tokenizer_svc.config import TokenizerServerConfig
from tokenizer_svc.server import load_served

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

served = load_served(TokenizerServerConfig(model_dir=Path(sys.argv[1])))
rng = random.Random(0)

def text(words):
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(200)) for _ in range(words))

served.tokenizer.encode(text(20))  # first-use allocations of the encoder itself
texts = [text(10) for _ in range(300)]  # made before measuring: only what encoding leaves behind counts
before = in_use()
for t in texts:
    served.tokenizer.encode(t)
print(in_use() - before)
"""


def test_encoding_new_long_words_leaves_nothing_allocated(tiny_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir)], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    held = int(out.stdout.split()[-1])
    assert held < HELD_LIMIT_BYTES, f"{held} bytes still allocated after encoding 3,000 distinct words"
