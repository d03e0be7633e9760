"""Client over the HTTP front end's OpenAI API (tritonlm-frontend, port 8080 under tritonlm-serve):
prompts through /v1/completions, conversations through /v1/chat/completions, streamed as
Server-Sent Events read line by line. Standard library only."""
from __future__ import annotations

import http.client
import json
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

from ._core import BaseClient, Completion, TritonLMError


class OpenAIClient(BaseClient):
    """tritonlm through the OpenAI API. `url` is "http://host:port" (or "host:port").

    The API returns no token ids, so Completion.token_ids stays empty; the token counts come
    from `usage`. A prompt without max_tokens generates until EOS or the context limit, as over
    Triton (the API's own default for completions is 16 tokens)."""

    def __init__(self, url: str = "http://localhost:8080", model: str = "llm",
                 timeout: float | None = None):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {url!r}")
        self._conn_class = (http.client.HTTPSConnection if parts.scheme == "https"
                            else http.client.HTTPConnection)
        self.host, self.port = parts.hostname or "localhost", parts.port
        self.model, self.timeout = model, timeout

    def _request(self, method: str, path: str, body: dict | None = None):
        conn = self._conn_class(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            raise TritonLMError(f"HTTP request to {self.host}:{self.port}{path} failed: {err}"
                                ) from None

    def _responses(self, fields: dict[str, Any]) -> Iterator[Completion]:
        path, body = _openai_body(fields, self.model)
        conn, resp = self._request("POST", path, body)
        chat = "messages" in body
        try:
            if not body["stream"]:
                yield _completion(_decode(resp.read(), resp.status), chat)
                return
            if resp.status != 200:
                _decode(resp.read(), resp.status)  # raises with the server's message
            while line := resp.readline():
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield _completion(_decode(data, resp.status), chat)
        except (OSError, http.client.HTTPException) as err:
            raise TritonLMError(f"HTTP stream from {self.host}:{self.port} broke: {err}") from None
        finally:
            conn.close()  # closing early makes the front end cancel the request

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling values the served model's generation_config sets (what a request that
        leaves them unset gets), as the front end reports them in TGI's GET /info; {} when it
        reports another model or none."""
        conn, resp = self._request("GET", "/info")
        try:
            info = _decode(resp.read(), resp.status)
        except TritonLMError:
            return {}
        finally:
            conn.close()
        if info.get("model_id") != self.model:
            return {}
        return dict(info.get("sampling_defaults") or {})

    def close(self) -> None:
        """Nothing to release: each request uses its own connection."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _openai_body(fields: Mapping[str, Any], model: str) -> tuple[str, dict]:
    """The route and body for a request's Triton fields (see _core.request_fields)."""
    body: dict[str, Any] = {"model": model, **json.loads(fields["sampling_parameters"])}
    if "messages" in fields:
        path = "/v1/chat/completions"
        body["messages"] = json.loads(fields["messages"])
        body["add_generation_prompt"] = fields.get("add_generation_prompt", True)
    else:
        path = "/v1/completions"
        body["prompt"] = fields["text_input"] if "text_input" in fields else fields["input_ids"]
        body.setdefault("max_tokens", None)  # until EOS, not the API's 16
    body["stream"] = bool(fields["stream"])
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return path, body


def _completion(body: dict, chat: bool) -> Completion:
    """One response or stream chunk (choices by index, usage on the last) as a Completion."""
    texts, reason = [], None
    for choice in body.get("choices", []):
        if chat:
            part = choice.get("message") or choice.get("delta") or {}
            text = part.get("content") or ""
        else:
            text = choice.get("text") or ""
        index = choice.get("index", 0)
        texts += [""] * (index + 1 - len(texts))
        texts[index] += text
        if index == 0 or reason is None:
            reason = choice.get("finish_reason") or reason
    usage = body.get("usage") or {}
    return Completion(text=texts[0] if texts else "", texts=texts, finish_reason=reason,
                      num_input_tokens=usage.get("prompt_tokens"),
                      num_output_tokens=usage.get("completion_tokens"))


def _decode(payload: bytes, status: int) -> dict:
    """A JSON response or SSE event; raises TritonLMError for an OpenAI error object."""
    try:
        body = json.loads(payload)
    except ValueError:
        raise TritonLMError(f"HTTP {status}: {payload.decode('utf-8', 'replace').strip()}"
                            ) from None
    if isinstance(body, dict) and "error" in body:
        error = body["error"]
        raise TritonLMError(str(error.get("message", error) if isinstance(error, dict) else error))
    if status != 200 or not isinstance(body, dict):
        raise TritonLMError(f"HTTP {status}: {body}")
    return body
