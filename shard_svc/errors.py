"""Named errors of the shard service. Every message names the sizes, ids and files involved."""


class KimiServeError(Exception):
    """Base of every error this engine raises on purpose."""


class ConfigError(KimiServeError):
    """config.json is missing, malformed, or describes something this engine does not run."""


class UnsupportedModelError(ConfigError):
    """Unknown model_type or an architecture option the engine does not implement."""


class UnsupportedQuantizationError(ConfigError):
    """A quantisation method or tensor format the loader does not understand; never reinterpreted."""


class CheckpointError(KimiServeError):
    """The checkpoint's tensors do not match what config.json says they must be."""


class CapacityError(KimiServeError):
    """A pool or buffer is full. Callers queue and retry; never a short view."""


class StateSlotsExhausted(CapacityError):
    """No free KDA state slot."""


class KVBlocksExhausted(CapacityError):
    """No free MLA KV-cache block."""


class ContextTooLong(KimiServeError):
    """A sequence would exceed the model's or the engine's maximum context."""


class InvalidRequest(KimiServeError):
    """A request's parameters are invalid (empty prompt, bad sampling values, token id out of range...)."""
