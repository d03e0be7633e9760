"""Client for tritonlm models served by Triton: gRPC streaming (`Client`), HTTP generate
(`HTTPClient`) and the HTTP front end's OpenAI API (`OpenAIClient`), each with generate / stream /
chat / chat_stream."""
from ._core import Completion, Delta, TritonLMError
from .grpc_client import Client
from .http_client import HTTPClient
from .openai_client import OpenAIClient

__all__ = ["Client", "HTTPClient", "OpenAIClient", "Completion", "Delta", "TritonLMError"]
