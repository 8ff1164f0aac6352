"""Host KV offload: the profile comes from the model's own layer map and the host pool is indexed by MLA cache index.

The 93-layer K3 topology has 24 MLA layers at engine indices 3, 7, ..., 87, 91, 92. A pool indexed by engine layer
(docs/lessons.md#no-silent-wrong-output: a pool sized for 27 layers, indexed by a 93-layer engine index) fails them
from engine layer 27 on.
"""

from __future__ import annotations

import pytest
import torch

from shard_svc.config import ModelConfig
from shard_svc.host_memory import HostMemoryError
from shard_svc.make_tiny import kimi_k3_config
from shard_svc.state.kv_offload import HostKVOffload, HostKVProfile
from shard_svc.state.pools import MLAKVCache
from shard_svc.weight_streaming.errors import ByteSizeMismatchError, StreamingConfigError
from shard_svc.weight_streaming.metrics import StreamingMetrics
from tests.engine.conftest import linear_config

K3_MLA = tuple(range(3, 92, 4)) + (92,)


@pytest.fixture(scope="module")
def k3() -> ModelConfig:
    return ModelConfig.from_dict(kimi_k3_config(93))


def mark_layers(cache: MLAKVCache, owner: str, profile: HostKVProfile) -> list[int]:
    """Writes each MLA layer's engine index (plus the token position / 1000) into `owner`'s pages, via the cache's
    own engine-layer accessor."""
    blocks = cache.blocks.table(owner)
    for layer in profile.mla_layers:
        view = cache.layer(layer)  # [blocks, block_size, latent]
        for i, block in enumerate(blocks):
            pos = torch.arange(cache.block_size, dtype=view.dtype).unsqueeze(-1) + i * cache.block_size
            view[block] = layer + pos / 1000
    return blocks


def test_k3_profile_comes_from_its_layer_map(k3):
    profile = HostKVProfile.from_config(k3)
    assert profile.num_layers == 93 and profile.num_mla == 24
    assert profile.mla_layers == K3_MLA
    assert [profile.index_of(layer) for layer in K3_MLA] == list(range(24))
    for layer in K3_MLA:
        if layer > 26:
            assert profile.index_of(layer) != layer and profile.index_of(layer) < 24
    assert profile.index_of(27) == 6 and profile.index_of(92) == 23  # the first MLA layer past 26, and the last
    with pytest.raises(StreamingConfigError, match="engine layer 28 is not an MLA layer"):
        profile.index_of(28)
    assert profile.page_bytes(16, torch.bfloat16) == 24 * 16 * k3.mla.latent_dim * 2


def test_profiles_are_per_model(k3):
    linear = ModelConfig.from_dict(linear_config(num_hidden_layers=27, linear_attn_config={
        "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "kda_layers": [i for i in range(1, 28) if i % 4 and i != 27]}))
    lp, kp = HostKVProfile.from_config(linear), HostKVProfile.from_config(k3)
    assert lp.mla_layers == (3, 7, 11, 15, 19, 23, 26) and kp.num_mla == 24
    assert lp.index_of(26) == 6 and kp.index_of(91) == 22 and kp.index_of(92) == 23


def test_93_layer_offload_round_trip_is_indexed_by_mla_index(k3):
    cache = MLAKVCache(k3, num_blocks=6, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    profile = HostKVProfile.from_config(k3)
    offload = HostKVOffload(cache, profile, host_pages=8)
    assert offload.host.shape == (24, 8, 4, k3.mla.latent_dim)  # sized by MLA layers, not engine layers
    cache.reserve("seq-a", 10)  # 3 blocks
    cache.reserve("seq-b", 4)
    mark_layers(cache, "seq-a", profile)
    expected_b = cache.kv[:, cache.blocks.table("seq-b")].clone()
    assert offload.offload("seq-a") == 3
    assert cache.blocks.table("seq-a") == [] and cache.blocks.num_free == 5 and offload.pages_on_host == 3
    pages = offload.pages.table("seq-a")
    for layer in K3_MLA:
        host = offload.layer_view(layer)  # by engine layer, mapped to its MLA index
        assert host.data_ptr() == offload.host[profile.index_of(layer)].data_ptr()
        values = host[pages].flatten(0, 1)  # [tokens, latent]
        assert torch.allclose(values[:, 0], layer + torch.arange(12.0) / 1000), f"engine layer {layer}"
    cache.reserve("seq-c", 8)  # the freed device blocks go to someone else and get written
    cache.kv[:, cache.blocks.table("seq-c")] = -1.0
    assert offload.restore("seq-a") == 3
    blocks = cache.blocks.table("seq-a")
    for layer in K3_MLA:
        values = cache.layer(layer)[blocks].flatten(0, 1)
        assert torch.allclose(values[:, 0], layer + torch.arange(12.0) / 1000), f"engine layer {layer}"
    assert torch.equal(cache.kv[:, cache.blocks.table("seq-b")], expected_b)  # a neighbour untouched
    assert offload.pages_on_host == 0 and not offload.is_offloaded("seq-a")


def test_host_pool_exhaustion_and_budget_are_named(k3):
    cache = MLAKVCache(k3, num_blocks=4, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    offload = HostKVOffload.for_budget(cache, k3, budget_bytes=2 * HostKVProfile.from_config(k3).page_bytes(
        4, torch.float32))
    assert offload.pages.num_blocks == 2
    cache.reserve("long", 12)
    with pytest.raises(HostMemoryError, match="2 of 2 pages free; 'long' needs 3"):
        offload.offload("long")
    assert cache.blocks.table("long")  # nothing moved
    with pytest.raises(HostMemoryError, match="at least one page"):
        HostKVOffload.for_budget(cache, k3, budget_bytes=100)


def test_page_copy_checks_bytes(k3, monkeypatch):
    cache = MLAKVCache(k3, num_blocks=2, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    offload = HostKVOffload(cache, HostKVProfile.from_config(k3), host_pages=2)
    offload.host = offload.host[:, :, :3]  # a host pool laid out for another block size
    cache.reserve("s", 4)
    with pytest.raises(ByteSizeMismatchError, match=r"device block .* host page"):
        offload.offload("s")


def test_offload_metrics(k3):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    cache = MLAKVCache(k3, num_blocks=4, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    offload = HostKVOffload(cache, HostKVProfile.from_config(k3), 4, StreamingMetrics(registry, "s0"))
    cache.reserve("s", 8)
    offload.offload("s")
    labels = {"shard": "s0", "rank": "0"}
    assert registry.get_sample_value("kimiserve_kv_host_pages", labels) == 2
    assert registry.get_sample_value("kimiserve_kv_pages_offloaded_total", labels) == 2
    offload.restore("s")
    assert registry.get_sample_value("kimiserve_kv_host_pages", labels) == 0
    assert registry.get_sample_value("kimiserve_kv_pages_restored_total", labels) == 2
