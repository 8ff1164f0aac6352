"""Router errors, each carrying the gRPC status it is answered with, and the one table from those statuses to HTTP
statuses (router/http)."""

import grpc


class RouterError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "", param: str | None = None):
        """param: the request field at fault, where one is (OpenAI's error.param on HTTP)."""
        super().__init__(message)
        self.param = param


class InvalidArgument(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Overloaded(RouterError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ShardUnavailable(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(RouterError):
    """The caller may see the thing but not change it (an admin key and another tenant's batch or file). Never used
    where the caller may not see it: that is NotFound, so ids say nothing across tenants."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(RouterError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ToolChoiceNotMet(RouterError):
    """A finished reply broke tool_choice 'required' or a named function although decoding enforced it (a stop
    string or stop token id cut it short): the backstop check of router/tool_choice.py."""

    code = grpc.StatusCode.INTERNAL


# The one table from the gRPC status of a named error to the HTTP status the HTTP API answers with.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
