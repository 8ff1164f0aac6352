"""Named errors of the tokenizer service. Messages name the files, ids, sizes and message indices involved."""


class TokenizerServiceError(Exception):
    """Base of every error this service raises on purpose."""


class UnsupportedModelType(TokenizerServiceError):
    """No registered tokenizer loader for the checkpoint's model_type."""


class InvalidRequest(TokenizerServiceError):
    """A request is malformed or over a size limit (mapped to INVALID_ARGUMENT)."""


class RenderError(InvalidRequest):
    """A chat conversation cannot be rendered: unknown role, malformed tool JSON, non-JSON tool-call arguments,
    an oversized message, or an exception from the chat template. The message names the message (or tool) index."""


class ModelNotFound(TokenizerServiceError):
    """A request named a model this service does not serve (mapped to NOT_FOUND)."""
