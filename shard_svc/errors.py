"""Named errors of the shard service. Every message names the sizes, ids and files involved."""


class KimiServeError(Exception):
    """Base of every error this engine raises on purpose."""


class ConfigError(KimiServeError):
    """config.json is missing, malformed, or describes something this engine does not run."""


class ConfigValueError(ConfigError):
    """A config.json value has the wrong type (a float such as 1e7 where a size is expected) or is outside its
    allowed range; the message names the key, the value, the range and the file."""


class UnsupportedModelError(ConfigError):
    """Unknown model_type or an architecture option the engine does not implement."""


class UnsupportedQuantizationError(ConfigError):
    """A quantisation method or tensor format the loader does not understand; never reinterpreted."""


class SchedulingConfigError(KimiServeError):
    """Prefill sharing settings that cannot work together (shard_svc/engine/prefill_share.py)."""


class CheckpointError(KimiServeError):
    """The checkpoint's tensors do not match what config.json says they must be."""


class CheckpointFileError(CheckpointError):
    """A weights file or the index is missing, truncated, corrupt or ambiguous; the message names the file."""


class CheckpointIndexConflict(CheckpointFileError):
    """model.safetensors and model.safetensors.index.json in one directory describe different weights (other files,
    other tensor names); the message lists the first differing names, their count and the files."""


class CheckpointMismatch(CheckpointError):
    """The tensors in the files differ from what config.json implies.

    One error lists every problem (missing, unexpected, shape, dtype, conflict, index), each with tensor and file;
    `problems` maps each kind to its full list of lines.
    """

    def __init__(self, message: str, problems: dict[str, list[str]]):
        super().__init__(message)
        self.problems = problems


class TensorValueError(CheckpointError):
    """A tensor's values break its format's rules (e.g. non-zero K3 A_log padding, an MXFP4 value that overflows)."""


class NaNScaleError(TensorValueError):
    """An MXFP4 E8M0 scale byte is 255, which the OCP MX spec defines as NaN."""


class UnfilledParameterError(CheckpointError):
    """A model parameter was not assigned from the checkpoint; it would run on uninitialised memory."""


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

    def __init__(self, message: str, param: str = ""):
        """param: the request field at fault, where one is (the router answers HTTP clients with it)."""
        super().__init__(message)
        self.param = param


class DuplicateRequest(InvalidRequest):
    """A request id that is already live on this engine."""
