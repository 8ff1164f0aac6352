"""`--device auto`: the GPU when torch sees one, else the CPU; and the device of each shard `kimiserve up` starts."""

from __future__ import annotations

DEVICE_HELP = "auto: the GPU when torch sees one (cuda), else the CPU; or cpu | cuda | cuda:N"


def resolve_device(device: str, cuda_available: bool | None = None) -> str:
    """`auto` -> "cuda" or "cpu"; anything else as given. cuda_available: None asks torch."""
    if device != "auto":
        return device
    if cuda_available is None:
        import torch  # here, not at import: `kimiserve up` and the CLI's other commands need no torch

        cuda_available = torch.cuda.is_available()
    return "cuda" if cuda_available else "cpu"


def shard_devices(device: str, shards: int, group: int, cuda_available: bool | None = None) -> list[str]:
    """The --device of each of `shards` shards of `group` ranks: shard i of a GPU stack gets cuda:i*group (its ranks
    the next group - 1 devices); on the CPU every shard gets `cpu`."""
    resolved = resolve_device(device, cuda_available)
    if resolved == "cuda":
        return [f"cuda:{i * group}" for i in range(shards)]
    return [resolved] * shards
