"""Errors that travel back to one request without disturbing the others."""


class InvalidRequestError(ValueError):
    """A request's input or parameters are invalid; the message names the field and value."""


class EngineFatalError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died): the model must stop serving."""


class OverloadedError(RuntimeError):
    """The server is full (max_concurrent_requests in flight): retry later. Triton's UNAVAILABLE;
    the front end answers 429, `error_type: overloaded`, which its message tells it."""
