"""Checkpoint loading in the published on-disk format (safetensors, sharded or not, MXFP4 routed experts)."""

from shard_svc.checkpoint.loader import load_model
from shard_svc.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from shard_svc.checkpoint.names import TensorSpec, expected_tensors

__all__ = ["TensorSpec", "dequantize_mxfp4", "expected_tensors", "load_model", "quantize_mxfp4"]
