"""`python3 -m training --out DIR`: see training/train.py."""

import sys

from training.train import main

sys.exit(main())
