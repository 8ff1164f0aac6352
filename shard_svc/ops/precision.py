"""The accumulation dtype of the eager ops: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 inputs.

fp64 exists so tests can check engine invariants (chunking, batching, slot reuse) far below fp32 rounding.
"""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)
