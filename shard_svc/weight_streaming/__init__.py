"""Models larger than the device: decoder layers streamed from host memory through a ring of device slots (native
engine in the repository's native/), routed experts copied per step. Host KV offload belongs to the KV manager
(shard_svc/state/kv_offload.py)."""

from shard_svc.weight_streaming.metrics import StreamingMetrics
from shard_svc.weight_streaming.mode import WEIGHT_MODES, add_weights_args, choose_mode, load_for_serving, weights_args
from shard_svc.weight_streaming.streamer import PassStreamStats, StreamOptions, WeightStreamer

__all__ = ["WEIGHT_MODES", "PassStreamStats", "StreamOptions", "StreamingMetrics", "WeightStreamer", "add_weights_args",
           "choose_mode", "load_for_serving", "weights_args"]
