"""The training script runs on a GPU machine that has torch, tokenizers, safetensors and numpy but none of the
services' other dependencies: running it must not import grpc, protobuf, jinja2, prometheus_client or tqdm."""

from __future__ import annotations

import subprocess
import sys

ABSENT_ON_THE_GPU_MACHINE = ("grpc", "google", "jinja2", "prometheus_client", "tqdm", "transformers")

# `--help` parses the arguments after every module of the script is imported, then exits 0.
GUARD = f"""
import runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:
            raise ImportError(f'the training script imported {{name}}, which the GPU machine does not have')
sys.meta_path.insert(0, Refuse())
import training.train
sys.argv = ['training', '--help']
runpy.run_module('training', run_name='__main__')
"""


def test_training_imports_only_what_the_gpu_machine_has():
    proc = subprocess.run([sys.executable, "-c", GUARD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--out" in proc.stdout
