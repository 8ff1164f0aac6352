"""Router errors, each carrying the gRPC status it is answered with (mapped in one place: service.py)."""

import grpc


class RouterError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Overloaded(RouterError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ShardUnavailable(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RouterError):
    code = grpc.StatusCode.ALREADY_EXISTS
