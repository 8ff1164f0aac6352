"""Input checks shared by the Triton kernels. A kernel that cannot run on its inputs raises `TritonKernelError`
naming the tensor, its shape, dtype and device; nothing here falls back to a slower path."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

from shard_svc.errors import KimiServeError

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Programmatic dependent launch for the decode-path kernels (see `pdl_args`); benchmarks switch it off to time the
# same kernels without it in the same run.
USE_PDL = True


class TritonKernelError(KimiServeError):
    """A Triton kernel was called with inputs it does not support (device, dtype, layout or size)."""


# The CPU interpreter has no SMs: small enough that test shapes reach the kernels' split paths.
INTERPRETER_SMS = 4


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`, which the kernels size their grids and splits against."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1), where CPU tensors are allowed."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision for a model computing in `dtype`. Triton multiplies fp32 operands as TF32 by default
    (~5e-4 rounding), which the eager fp32 reference does not; a 93-layer top-k MoE turns that into other tokens
    (README, Trained models). So fp32 products are exact fp32 ("ieee"); at bf16 the operands are exact in TF32
    anyway, and the kernels that widen bf16 to fp32 operands keep the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    """Hopper or later, and a Triton with the PDL launch option and grid dependency control (logged once when this
    Triton lacks them)."""
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    import triton
    import triton.language.extra.cuda as cuda_extra
    from triton.backends.nvidia.compiler import CUDAOptions

    if "launch_pdl" not in {f.name for f in dataclasses.fields(CUDAOptions)} or not hasattr(cuda_extra, "gdc_wait"):
        log.warning("programmatic dependent launch off: this Triton (%s) has no launch_pdl option or gdc_wait",
                    triton.__version__)
        return False
    return True


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch arguments of a kernel that begins with `jit_helpers.pdl_prologue(PDL)`: on a Hopper GPU it is
    launched with programmatic dependent launch, so its launch overlaps the previous kernel's tail instead of
    following it (in a captured decode step, one gap fewer per kernel); its prologue waits for the previous kernel's
    memory before anything is read or written. Off under the interpreter and before Hopper."""
    on = (USE_PDL and device.type == "cuda" and not interpreting()
          and _pdl_capable(device.index if device.index is not None else torch.cuda.current_device()))
    return {"PDL": on, "launch_pdl": on}


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


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without a host sync: staged in pinned memory and copied asynchronously (the
    caching host allocator keeps the staging buffer until the copy has run). On the CPU, the tensor itself."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def pow2_at_least(n: int, floor: int = 1) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def check_mla_layer(op: str, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                    block_tables: torch.Tensor, ctx_lens: torch.Tensor, cu_seqlens: torch.Tensor
                    ) -> tuple[int, int, int, int, int, int, int, int]:
    """Validates the MLA op contract (ops/mla/eager.py::mla_attention) shared by the MLA kernels.

    Returns (tokens, heads, nope, rope, kv_lora, v_dim, block_size, cache width)."""
    check(op, "q_nope", q_nope, dims=3)
    check(op, "q_pe", q_pe, dims=3)
    check(op, "kv_cache", kv_cache, dims=3)
    check(op, "w_kv_b", w_kv_b, dims=2)
    check(op, "block_tables", block_tables, dtypes=(torch.int32, torch.int64), dims=2)
    t, nh, nope = q_nope.shape
    rope, kv_lora = q_pe.shape[2], w_kv_b.shape[1]
    v_dim = w_kv_b.shape[0] // nh - nope
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    check_index(op, "ctx_lens", ctx_lens, block_tables.shape[0])
    check_index(op, "cu_seqlens", cu_seqlens, block_tables.shape[0] + 1)
    if tuple(q_pe.shape[:2]) != (t, nh) or width != kv_lora + rope or v_dim <= 0 or \
            w_kv_b.shape[0] != nh * (nope + v_dim):
        raise TritonKernelError(f"{op}: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, kv_cache "
                                f"{tuple(kv_cache.shape)}, w_kv_b {tuple(w_kv_b.shape)} do not fit one MLA layer "
                                f"(cache width must be kv_lora {kv_lora} + rope {rope})")
    return t, nh, nope, rope, kv_lora, v_dim, block_size, width
