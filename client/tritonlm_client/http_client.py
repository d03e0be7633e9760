"""HTTP client over Triton's generate extension: /generate (one JSON response) and
/generate_stream (Server-Sent Events, read incrementally). Standard library only."""
from __future__ import annotations

import http.client
import json
from typing import Any, Iterator
from urllib.parse import quote, urlsplit

from ._core import BaseClient, Completion, TritonLMError, defaults_from_parameters, parse_outputs


class HTTPClient(BaseClient):
    """tritonlm over HTTP. `url` is "host:port" or "http://host:port"."""

    def __init__(self, url: str = "localhost:8000", model: str = "llm", timeout: float | None = None):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {url!r}")
        self._conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.host, self.port = parts.hostname or "localhost", parts.port
        self.model, self.timeout = model, timeout

    def _request(self, endpoint: str, fields: dict[str, Any] | None, method: str = "POST"):
        conn = self._conn_class(self.host, self.port, timeout=self.timeout)
        path = f"/v2/models/{quote(self.model, safe='')}/{endpoint}"
        try:
            conn.request(method, path, body=None if fields is None else json.dumps(fields).encode(),
                         headers={"Content-Type": "application/json"})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            raise TritonLMError(f"HTTP request to {self.host}:{self.port}{path} failed: {err}") from None

    def _responses(self, fields: dict[str, Any]) -> Iterator[Completion]:
        if fields["stream"]:
            yield from self._sse(fields)
            return
        conn, resp = self._request("generate", fields)
        try:
            body = _decode(resp.read(), resp.status)
        finally:
            conn.close()
        yield parse_outputs(body)

    def _sse(self, fields: dict[str, Any]) -> Iterator[Completion]:
        conn, resp = self._request("generate_stream", fields)
        try:
            if resp.status != 200 and "text/event-stream" not in (resp.getheader("Content-Type") or ""):
                _decode(resp.read(), resp.status)  # raises with the server's message
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.strip()
                if line.startswith(b"data:"):
                    yield parse_outputs(_decode(line[5:], resp.status))
        except (OSError, http.client.HTTPException) as err:
            raise TritonLMError(f"HTTP stream from {self.host}:{self.port} broke: {err}") from None
        finally:
            conn.close()  # closing early makes Triton cancel the request

    def sampling_defaults(self) -> dict[str, Any]:
        """`default_<key>` parameters of the model's config (none: {})."""
        conn, resp = self._request("config", None, method="GET")
        try:
            config = _decode(resp.read(), resp.status)
        finally:
            conn.close()
        return defaults_from_parameters(config.get("parameters", {}))

    def close(self) -> None:
        """Nothing to release: each request uses its own connection."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _decode(payload: bytes, status: int) -> dict:
    """A JSON response or SSE event; raises TritonLMError for {"error": ...} or non-JSON errors."""
    try:
        body = json.loads(payload)
    except ValueError:
        raise TritonLMError(f"HTTP {status}: {payload.decode('utf-8', 'replace').strip()}") from None
    if isinstance(body, dict) and "error" in body:
        raise TritonLMError(str(body["error"]))
    if status != 200 or not isinstance(body, dict):
        raise TritonLMError(f"HTTP {status}: {body}")
    return body
