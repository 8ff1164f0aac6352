"""`python -m tokenizer_svc --model DIR --port P [--metrics-port M]`."""

import sys

from tokenizer_svc.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
