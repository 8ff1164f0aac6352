"""Checkpoint loading in the published on-disk format (safetensors, sharded or not, MXFP4 routed experts).

The public API: `load_model` (and `load_dummy`) load a whole model; the fill helpers (fill.py) are what every other
loader of a checkpoint builds on, so a streamed or sharded model holds the values the resident one does:
`load_dtype`, `fill_value`, `convert_stored`, `fill_sources`, `check_all_filled`, `check_nothing_on_meta`.
"""

from shard_svc.checkpoint.dummy import load_dummy
from shard_svc.checkpoint.fill import (check_all_filled, check_nothing_on_meta, convert_stored, fill_sources,
                                       fill_value, load_dtype)
from shard_svc.checkpoint.loader import load_model
from shard_svc.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from shard_svc.checkpoint.names import TensorSpec, expected_tensors

# --load-format: how a shard or `generate` gets its weights.
LOAD_FORMATS = {"safetensors": load_model, "dummy": load_dummy}

__all__ = ["LOAD_FORMATS", "TensorSpec", "check_all_filled", "check_nothing_on_meta", "convert_stored",
           "dequantize_mxfp4", "expected_tensors", "fill_sources", "fill_value", "load_dtype", "load_dummy",
           "load_model", "quantize_mxfp4"]
