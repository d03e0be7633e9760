"""Errors that travel back to one request without disturbing the others."""


class InvalidRequestError(ValueError):
    """A request's input or parameters are invalid; the message names the field and value."""


class EngineFatalError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died): the model must stop serving."""
