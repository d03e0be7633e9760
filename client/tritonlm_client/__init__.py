"""Client for tritonlm models served by Triton: gRPC streaming (`Client`) and HTTP generate
(`HTTPClient`), both with generate / stream / chat / chat_stream."""
from ._core import Completion, Delta, TritonLMError
from .grpc_client import Client
from .http_client import HTTPClient

__all__ = ["Client", "HTTPClient", "Completion", "Delta", "TritonLMError"]
