"""MXFP4 (OCP MX, compressed-tensors `mxfp4-pack-quantized`, groups of 32) pack and unpack.

Layout (docs/models.md#mxfp4-experts): `weight_packed` uint8 [out, in/2], two E2M1 codes per byte, LOW NIBBLE FIRST;
code bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. `weight_scale` uint8
[out, in/32] is an E8M0 exponent per group: the multiplier is 2^(byte - 127). A scale byte is never a value
(docs/lessons.md#no-silent-wrong-output: 121 means 2^-6, not 121.0), and byte 255 is NaN, which is refused.
"""

from __future__ import annotations

import torch

from shard_svc.errors import NaNScaleError, TensorValueError

GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     name: str = "mxfp4") -> torch.Tensor:
    """packed uint8 [out, in/2], scale uint8 [out, in/32] -> weight [out, in] in `dtype`, exactly.

    `name` (tensor and file) goes into every error message. Raises NaNScaleError on a 255 scale byte and
    TensorValueError when a value does not fit `dtype` (it would become inf).
    """
    _check_layout(packed, scale, name)
    nan = (scale == E8M0_NAN).nonzero()
    if len(nan):
        row, group = nan[0].tolist()
        raise NaNScaleError(f"{name}: {len(nan)} E8M0 scale bytes are 255 (NaN per the OCP MX spec), first at "
                            f"row {row} group {group}; refusing to dequantise")
    out, half = packed.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, 2 * half)  # low nibble first
    values = _E2M1_VALUES.to(packed.device)[codes.long()].view(out, -1, GROUP)  # [out, groups, 32]
    # The byte is an exponent: exp2 of an integer in [-127, 127] is exact in fp32 (2^-127 is a subnormal).
    multiplier = torch.exp2(scale.to(torch.int32).sub(E8M0_BIAS).float()).unsqueeze(-1)
    weight = (values * multiplier).view(out, 2 * half).to(dtype)
    if not torch.isfinite(weight).all():
        raise TensorValueError(f"{name}: dequantised MXFP4 values overflow {dtype} (scale bytes up to "
                               f"{int(scale.max())}); refusing")
    return weight


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) -> (packed uint8 [out, in/2], scale uint8 [out, in/32]).

    Per group the scale is the smallest power of two that brings the group's max magnitude within 6; values are
    rounded to the nearest E2M1 magnitude (ties to the smaller one). Used to write tiny test checkpoints.
    """
    out, width = weight.shape
    if width % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {width}")
    groups = weight.float().reshape(out, width // GROUP, GROUP)
    amax = groups.abs().amax(-1)  # [out, groups]
    exponent = torch.ceil(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny) / 6.0))
    exponent = exponent + (amax > 6.0 * torch.exp2(exponent)).float()  # guard log2 rounding
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    magnitude_code = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)  # [out, groups, 32]
    sign = ((scaled < 0) & (magnitude_code > 0)).to(torch.int64) << 3
    codes = (magnitude_code | sign).to(torch.uint8).reshape(out, width)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)


def _check_layout(packed: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TensorValueError(f"{name}: MXFP4 tensors must be uint8, got packed {packed.dtype}, scale {scale.dtype}")
    if packed.dim() != 2 or scale.dim() != 2 or packed.shape[0] != scale.shape[0] or (
        packed.shape[1] * 2 != scale.shape[1] * GROUP
    ):
        raise TensorValueError(f"{name}: MXFP4 packed {list(packed.shape)} and scale {list(scale.shape)} do not "
                               f"describe one [out, in] weight with groups of {GROUP}")
