"""One error type for every API; each API renders it in its own shape (OpenAI's error object,
TGI's {"error", "error_type"})."""
from __future__ import annotations


class APIError(Exception):
    """A request that cannot be served: the HTTP status and a message naming the cause."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def kind(self) -> str:
        """OpenAI's error type for the status (TGI's error_type is derived from it too)."""
        return _KINDS.get(self.status, "InternalServerError" if self.status >= 500
                          else "BadRequestError")


_KINDS = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError",
          429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError",
          503: "ServiceUnavailableError"}

# Triton does not carry a status code through a gRPC stream's error message; these are how its
# messages (and the engine's) name the causes that are not the request's own fault.
_NOT_FOUND = ("unknown model", "is not found", "is not ready")
_OVERLOADED = ("exceeds maximum queue size", "too many requests", "overloaded")
_SERVER_SIDE = ("internal error", "engine died", "engine stopped", "failed on rank",
                "unavailable", "socket closed", "connect failed", "deadline exceeded")


def from_triton_message(message: str) -> APIError:
    """The APIError for an error message from tritonserver or the engine behind it."""
    lowered = message.lower()
    if any(s in lowered for s in _NOT_FOUND):
        return APIError(404, message, "model")
    if any(s in lowered for s in _OVERLOADED):
        return APIError(429, message)
    if any(s in lowered for s in _SERVER_SIDE):
        return APIError(500, message)
    return APIError(400, message)
