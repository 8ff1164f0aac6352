"""Models larger than the device: decoder layers streamed from host memory through a ring of device slots (native
engine in native_src/), routed experts copied per step, and the MLA latent cache offloaded to host memory."""

from shard_svc.streaming.kv_offload import HostKVOffload, HostKVProfile
from shard_svc.streaming.metrics import StreamingMetrics
from shard_svc.streaming.mode import WEIGHT_MODES, add_weights_args, choose_mode, load_for_serving, weights_args
from shard_svc.streaming.streamer import PassStreamStats, StreamOptions, WeightStreamer

__all__ = ["HostKVOffload", "HostKVProfile", "PassStreamStats", "StreamOptions", "StreamingMetrics", "WEIGHT_MODES",
           "WeightStreamer", "add_weights_args", "choose_mode", "load_for_serving", "weights_args"]
