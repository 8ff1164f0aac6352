"""MXFP4 dequantisation against bytes decoded by hand (docs/models.md#mxfp4-experts), and make-tiny's quantiser."""

from __future__ import annotations

import pytest
import torch

from shard_svc.checkpoint import dequantize_mxfp4, quantize_mxfp4
from shard_svc.errors import NaNScaleError, TensorValueError


def one_group(first_bytes: list[int], scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of one 32-value group: the given leading bytes, zero bytes after."""
    packed = torch.tensor([first_bytes + [0] * (16 - len(first_bytes))], dtype=torch.uint8)
    return packed, torch.tensor([[scale]], dtype=torch.uint8)


def test_byte_0x2f_scale_127():
    # low nibble 0xF = sign + code 7 = -6.0 comes first; high nibble 0x2 = +1.0; multiplier 2^(127-127) = 1.
    w = dequantize_mxfp4(*one_group([0x2F], 127), torch.float32)
    assert w.shape == (1, 32)
    assert w[0, :2].tolist() == [-6.0, 1.0] and w[0, 2:].eq(0).all()


def test_scale_byte_is_an_exponent_not_a_value():
    # 121 means 2^(121-127) = 1/64, never 121.0 (docs/lessons.md#no-silent-wrong-output).
    w = dequantize_mxfp4(*one_group([0x2F], 121), torch.float32)
    assert w[0, :2].tolist() == [-6.0 / 64, 1.0 / 64] == [-0.09375, 0.015625]


def test_all_sixteen_codes_low_nibble_first():
    # bytes 0x10, 0x32, ... hold codes 0,1 | 2,3 | ... | 14,15 in order when the low nibble comes first.
    w = dequantize_mxfp4(*one_group([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], 128), torch.float32)
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert w[0, :16].tolist() == [2 * m for m in magnitudes] + [-2 * m for m in magnitudes]


def test_groups_of_32_each_use_their_own_scale():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # every code is 2 -> 1.0
    scale = torch.tensor([[127, 130], [0, 254]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale, torch.float32)
    assert w[0, :32].eq(1.0).all() and w[0, 32:].eq(8.0).all()
    assert w[1, :32].eq(2.0**-127).all() and w[1, 32:].eq(2.0**127).all()  # both ends of E8M0 are exact


def test_bfloat16_output_is_exact():
    packed, scale = one_group([0x3F, 0x09], 120)  # 2^-7
    w = dequantize_mxfp4(packed, scale, torch.bfloat16)
    assert w.dtype == torch.bfloat16
    assert w[0, :4].float().tolist() == [-6 / 128, 1.5 / 128, -0.5 / 128, 0.0]


def test_nan_scale_255_is_refused_with_the_tensor_name():
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    scale = torch.tensor([[127, 127], [127, 255]], dtype=torch.uint8)
    with pytest.raises(NaNScaleError, match=r"experts.0.w1 \(shard-1\): 1 E8M0 scale bytes are 255 .* row 1 group 1"):
        dequantize_mxfp4(packed, scale, torch.bfloat16, name="experts.0.w1 (shard-1)")


def test_overflowing_value_is_refused():
    with pytest.raises(TensorValueError, match="overflow"):
        dequantize_mxfp4(*one_group([0x07], 254), torch.float32)  # 6 * 2^127 > float32 max
    with pytest.raises(TensorValueError, match="overflow"):
        dequantize_mxfp4(*one_group([0x07], 127 + 16), torch.float16)  # 6 * 2^16 > float16 max


def test_layout_mismatch_is_refused():
    with pytest.raises(TensorValueError, match="groups of 32"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), torch.float32)
    with pytest.raises(TensorValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), torch.float32)


def test_quantize_hand_example():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -6.0 / 64, 1.0 / 64
    packed, scale = quantize_mxfp4(w)
    assert packed[0, 0].item() == 0x2F and packed[0, 1:].eq(0).all() and scale.tolist() == [[121]]


def test_quantize_then_dequantize_is_within_half_a_grid_step():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (16, 48) and scale.shape == (16, 3) and packed.dtype == scale.dtype == torch.uint8
    back = dequantize_mxfp4(packed, scale, torch.float32)
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)  # the grid's largest gap (4 -> 6) is 2
    assert ((back - w).abs() <= step).all()
    amax = w.view(16, 3, 32).abs().amax(-1)
    assert (amax <= 6 * torch.exp2(scale.float() - 127)).all() and (amax > 3 * torch.exp2(scale.float() - 127)).all()


def test_dequantized_values_survive_a_second_round_trip_exactly():
    packed = torch.randint(0, 256, (8, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    scale = torch.randint(100, 150, (8, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    values = dequantize_mxfp4(packed, scale, torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(values), torch.float32), values)
