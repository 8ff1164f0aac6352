"""Checkpoint loading in the published on-disk format (safetensors, sharded or not, MXFP4 routed experts)."""

from shard_svc.checkpoint.dummy import load_dummy
from shard_svc.checkpoint.loader import load_model
from shard_svc.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from shard_svc.checkpoint.names import TensorSpec, expected_tensors

# --load-format: how a shard or `generate` gets its weights.
LOAD_FORMATS = {"safetensors": load_model, "dummy": load_dummy}

__all__ = ["LOAD_FORMATS", "TensorSpec", "dequantize_mxfp4", "expected_tensors", "load_dummy", "load_model",
           "quantize_mxfp4"]
