"""Input checks shared by the Triton kernels. A kernel that cannot run on its inputs raises `TritonKernelError`
naming the tensor, its shape, dtype and device; nothing here falls back to a slower path."""

from __future__ import annotations

import os

import torch

from shard_svc.errors import KimiServeError

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TritonKernelError(KimiServeError):
    """A Triton kernel was called with inputs it does not support (device, dtype, layout or size)."""


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1), where CPU tensors are allowed."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check(op: str, name: str, x: torch.Tensor, *, dtypes=KERNEL_DTYPES, dims: int | None = None,
          last_contiguous: bool = True) -> None:
    # Cheap tests first, the message only on failure: this runs on every decode step.
    if ((x.is_cuda or interpreting()) and (dtypes is None or x.dtype in dtypes) and (dims is None or x.dim() == dims)
            and (not last_contiguous or x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1)):
        return
    where = f"{op}: {name} {tuple(x.shape)} {x.dtype} on {x.device}"
    if not x.is_cuda and not interpreting():
        raise TritonKernelError(f"{where}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    if dtypes is not None and x.dtype not in dtypes:
        raise TritonKernelError(f"{where}: dtype must be one of {[str(d) for d in dtypes]}")
    if dims is not None and x.dim() != dims:
        raise TritonKernelError(f"{where}: expected {dims} dims")
    raise TritonKernelError(f"{where}: last dim must be contiguous (strides {x.stride()})")


def check_index(op: str, name: str, x: torch.Tensor, length: int) -> None:
    check(op, name, x, dtypes=(torch.int32, torch.int64), dims=1)
    if x.shape[0] != length:
        raise TritonKernelError(f"{op}: {name} has {x.shape[0]} entries, expected {length}")


def pow2_at_least(n: int, floor: int = 1) -> int:
    p = floor
    while p < n:
        p *= 2
    return p
