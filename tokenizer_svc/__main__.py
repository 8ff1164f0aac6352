"""`python -m tokenizer_svc --model DIR --port P [--metrics-port M]`: the same as `kimiserve tokenizer ...`."""

import sys

from kimiserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["tokenizer", *sys.argv[1:]]))
