"""The Kimi model family (Kimi-Linear and Kimi-K3) as one eager model over the op seam."""

from shard_svc.model.kimi import KimiForCausalLM

__all__ = ["KimiForCausalLM"]
