"""`python -m tokenizer_svc --model DIR --port P [--metrics-port M]`: the same as `kimiserve tokenizer ...`, in the
same frame (kimiserve/command.py), without the launcher above the services."""

import sys

from kimiserve.command import main

COMMANDS = {"tokenizer": ("tokenizer_svc.main", "add_args", "run", "serve a checkpoint's tokenizer")}
USER_ERRORS = {
    "kimiserve.tokenizer_files.errors": ("TokenizerLoadError",),
    "tokenizer_svc.errors": ("UnsupportedModelType",),
    "kimiserve.security": ("SecurityConfigError",),
    "kimiserve.ports": ("PortInUse",),
}

if __name__ == "__main__":
    sys.exit(main(COMMANDS, USER_ERRORS, ["tokenizer", *sys.argv[1:]]))
