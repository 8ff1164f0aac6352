"""A training step's forward and backward replayed as one CUDA graph.

The small models train launch-bound: a step of the 93-layer K3 at width 64 runs ~20,000 ops forward and ~32,000
backward (counted on the CPU; bf16 adds casts), each a kernel launch on the GPU, so an H200 step took 2.2 s and the
170 s budget bought 31 steps. Every step has
the same shapes (`batch` x `seq_len`) and the pass makes no host sync (`tests/training/test_graphed.py` checks), so
the forward and backward are captured once, as PyTorch's whole-network capture does, and each step copies its batch
into the captured inputs and replays: one launch. The optimiser step stays outside (a few foreach kernels).

What the graph reads by address and the trainer changes in place between replays: the parameters (copied from the
fp32 masters), the router biases (balanced after each step) and the inputs. What it writes: the loss, every
parameter's `.grad` (never reset to None in this mode) and the router's per-layer loads.
"""

from __future__ import annotations

from typing import Callable

import torch

from training.data import Batch

WARMUP_PASSES = 3  # on a side stream before capture, as torch.cuda.graph requires (allocator, lazy inits)


class CapturedPassError(RuntimeError):
    """The captured pass cannot serve this batch (another shape or device)."""


class CapturedPass:
    """forward + backward of `loss_of(batch)` captured at `batch`'s shapes; `run` replays it on new values."""

    def __init__(self, loss_of: Callable[[Batch], torch.Tensor], params: list[torch.Tensor], batch: Batch,
                 loads: list[torch.Tensor]):
        if batch.inputs.device.type != "cuda":
            raise CapturedPassError(f"CUDA graphs need the batch on a CUDA device, got {batch.inputs.device}")
        self.inputs, self.targets = batch.inputs.clone(), batch.targets.clone()
        static = Batch(self.inputs, self.targets)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                _clear(params, loads)
                loss_of(static).backward()
        torch.cuda.current_stream().wait_stream(side)
        _clear(params, loads)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = loss_of(static)
            self.loss.backward()
        self.loads = list(loads)  # the captured pass's own load tensors, rewritten by each replay

    def run(self, batch: Batch) -> torch.Tensor:
        """The loss of `batch` (a device tensor), with every parameter's .grad and `self.loads` written."""
        if batch.inputs.shape != self.inputs.shape or batch.targets.shape != self.targets.shape:
            raise CapturedPassError(f"batch {tuple(batch.inputs.shape)} / {tuple(batch.targets.shape)} against the "
                                    f"captured {tuple(self.inputs.shape)} / {tuple(self.targets.shape)}")
        self.inputs.copy_(batch.inputs)
        self.targets.copy_(batch.targets)
        self.graph.replay()
        return self.loss


def _clear(params: list[torch.Tensor], loads: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None
    loads.clear()
