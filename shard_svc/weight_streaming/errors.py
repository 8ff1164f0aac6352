"""Named errors of weight streaming and host KV offload. The native engine raises these same classes (by kind)."""

from shard_svc.errors import KimiServeError


class StreamingError(KimiServeError):
    """Base of every weight-streaming and KV-offload error."""


class MissingSlotError(StreamingError):
    """A host tensor (or a whole layer) was needed on the device but no slot holds it; never a stale fall-through."""


class ByteSizeMismatchError(StreamingError):
    """A copy's source and destination hold different numbers of bytes; checked before every copy."""


class SlotMapError(StreamingError):
    """A slot map is malformed: misaligned, overlapping, or past the end of the slot."""


class ShortSlotMapError(SlotMapError):
    """A layer's slot map does not cover every tensor of the layer."""


class SlotBusyError(StreamingError):
    """A fetch would overwrite a slot that a kernel may still read (or that holds an unused prefetch)."""


class UnusedPrefetchError(StreamingError):
    """A forward pass ended with layers fetched for it that it never ran (a skipped streamed layer)."""


class NotPinnedError(StreamingError):
    """A host tensor in pageable memory was given to the CUDA engine, which copies asynchronously."""


class NotHostTensorError(StreamingError):
    """A tensor registered as host memory is not on the CPU or not contiguous."""


class NativeBuildError(StreamingError):
    """The native engine could not be built or loaded, or the build does not match the device."""


class DeviceCopyError(StreamingError):
    """A CUDA driver call of the copy engine failed; the message names the call and the CUDA error."""


class StreamingConfigError(StreamingError):
    """Streaming options that cannot work together (e.g. fewer slots than the prefetch depth needs)."""


# kind used by native/stream_engine.cpp -> class raised in Python
NATIVE_KINDS = {
    "MissingSlot": MissingSlotError,
    "ByteSizeMismatch": ByteSizeMismatchError,
    "SlotMap": SlotMapError,
    "ShortSlotMap": ShortSlotMapError,
    "SlotBusy": SlotBusyError,
    "NotPinned": NotPinnedError,
    "NotHost": NotHostTensorError,
    "NativeBuild": NativeBuildError,
    "Cuda": DeviceCopyError,
}
