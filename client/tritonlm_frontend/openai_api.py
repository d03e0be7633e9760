"""The OpenAI API as vLLM's server serves it: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import APIError
from .generations import (GenerationResult, SequenceResult, clamped_logprob, collect,
                          first_and_rest, merged)
from .http_utils import read_body, request_id, sse_event, sse_response, unless_disconnected
from .openai_protocol import ChatCompletionRequest, CompletionRequest
from .tool_calls import ToolCalling
from .triton_gateway import GenerateRequest, SequenceDelta

router = APIRouter()


def _fingerprint(model: str) -> str:
    return f"tritonlm-{model}"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chat_logprob(entry: dict) -> dict:
    token = entry["token"]
    return {"token": token, "logprob": clamped_logprob(entry["logprob"]),
            "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[dict]) -> dict:
    """The engine's per-token logprob entries in the chat API's shape."""
    return {"content": [{**_chat_logprob(e), "top_logprobs": [_chat_logprob(t) for t in
                                                               e.get("top_logprobs", [])]}
                        for e in entries]}


def completion_logprobs(entries: list[dict | None], text_start: int = 0) -> dict:
    """Logprob entries (prompt entries first when echoed; the first prompt token's is None)
    in the completions API's shape, with each token's offset into the choice's text."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], text_start
    for entry in entries:
        tokens.append(entry["token"])
        token_logprobs.append(clamped_logprob(entry["logprob"]))
        alternatives = entry.get("top_logprobs") or []
        top.append({t["token"]: clamped_logprob(t["logprob"]) for t in alternatives}
                   if entry["logprob"] is not None else None)
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


@router.get("/v1/models")
async def list_models(request: Request):
    catalog = request.app.state.catalog
    await catalog.refresh()
    models = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "tritonlm",
               "root": m.name, "parent": None, "max_model_len": m.max_model_len}
              for m in catalog.models.values()]
    adapters = [{"id": a, "object": "model", "created": m.created, "owned_by": "tritonlm",
                 "root": a, "parent": m.name, "max_model_len": m.max_model_len}
                for m in catalog.models.values() for a in m.adapters]
    return {"object": "list", "data": models + adapters}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    body = await read_body(request, ChatCompletionRequest)
    body.check_stream_options()
    model, adapter = await request.app.state.catalog.resolve(body.model)
    tools = ToolCalling.from_request(body.tools, body.tool_choice, model.chat_template)
    sampling, template_kwargs = _with_adapter(body.sampling(), adapter), body.chat_template_kwargs
    if tools is not None:
        template_kwargs = {**(template_kwargs or {}), "tools": tools.tools}
        constraint = tools.structured_outputs()
        if constraint is not None:
            if "structured_outputs" in sampling or any(k.startswith("guided_") for k in sampling):
                raise APIError(400, "tool_choice and response_format (or guided_*) both "
                               "constrain the reply: give one", "tool_choice")
            sampling["structured_outputs"] = constraint
    generate = GenerateRequest(model.name, messages=body.engine_messages(),
                               add_generation_prompt=body.add_generation_prompt,
                               chat_template_kwargs=template_kwargs,
                               sampling=sampling, stream=body.stream,
                               logprobs=body.logprobs, request_id=request_id(request))
    gateway = request.app.state.gateway
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": response_id, "created": created, "model": adapter or model.name,
            "system_fingerprint": _fingerprint(model.name)}
    if body.stream:
        chunks = await unless_disconnected(request, lambda: first_and_rest(
            merged(gateway, [generate])))
        return sse_response(_chat_events(chunks, head, body, tools))
    result, = await unless_disconnected(request, lambda: collect(gateway, [generate]))
    choices = [{"index": i, **_reply(s.text, s.finish_reason, tools),
                "logprobs": chat_logprobs(s.logprobs) if body.logprobs else None,
                "stop_reason": s.stop_reason}
               for i, s in enumerate(result.sequences)]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": _usage(result.num_input_tokens, result.num_output_tokens)})


def _with_adapter(sampling: dict, adapter: str | None) -> dict:
    return sampling if adapter is None else {**sampling, "lora_name": adapter}


def _reply(text: str, finish_reason: str | None, tools: ToolCalling | None) -> dict:
    """A finished choice's message and finish_reason: its tool calls where it made any."""
    calls = tools.calls(text) if tools is not None and finish_reason == "stop" else None
    if calls is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    tool_calls, rest = calls
    return {"message": {"role": "assistant", "content": rest, "tool_calls": tool_calls},
            "finish_reason": "tool_calls"}


async def _chat_events(chunks, head: dict, body: ChatCompletionRequest,
                       tools: ToolCalling | None):
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if body.include_usage else {}
    started, prompt_tokens, completion_tokens = set(), 0, 0
    held: dict[int, str] = {}  # tool calling: a choice's text, read as calls when it ends
    try:
        async for _, chunk in chunks:
            prompt_tokens = chunk.num_input_tokens or prompt_tokens
            for seq in chunk.sequences:
                completion_tokens += len(seq.token_ids)
                if seq.index not in started:
                    started.add(seq.index)
                    yield sse_event({**head, **extra, "choices": [{
                        "index": seq.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                if tools is not None:
                    held[seq.index] = held.get(seq.index, "") + seq.text
                    if seq.finish_reason:
                        yield sse_event({**head, **extra, "choices": [_tool_call_delta(
                            seq, held[seq.index], body, tools)]})
                elif seq.text or seq.finish_reason or seq.token_ids:
                    yield sse_event({**head, **extra, "choices": [_chat_choice_delta(seq, body)]})
        if body.include_usage:
            yield sse_event({**head, "choices": [], "usage": _usage(prompt_tokens,
                                                                    completion_tokens)})
    except APIError as error:
        yield sse_event({"error": {"message": error.message, "type": error.kind,
                                   "param": error.param, "code": error.status}})
    yield sse_event("[DONE]")


def _tool_call_delta(seq: SequenceDelta, text: str, body: ChatCompletionRequest,
                     tools: ToolCalling) -> dict:
    """A tool-calling choice's reply, in one delta when it ends: its calls (with their index),
    or its text where it made none."""
    reply = _reply(text, seq.finish_reason, tools)
    message = reply["message"]
    delta = {"content": message["content"]} if message["content"] else {}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return {"index": seq.index, "delta": delta, "logprobs": None,
            "finish_reason": reply["finish_reason"], "stop_reason": seq.stop_reason}


def _chat_choice_delta(seq: SequenceDelta, body: ChatCompletionRequest) -> dict:
    return {"index": seq.index, "delta": {"content": seq.text} if seq.text else {},
            "logprobs": chat_logprobs(seq.logprobs) if body.logprobs else None,
            "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}


@router.post("/v1/completions")
async def completions(request: Request):
    body = await read_body(request, CompletionRequest)
    body.check_stream_options()
    model, adapter = await request.app.state.catalog.resolve(body.model)
    sampling = _with_adapter(body.sampling(), adapter)
    logprobs = body.logprobs is not None
    prompts, rid = body.prompts(), request_id(request)
    generates = [GenerateRequest(model.name, prompt=p, sampling=sampling, stream=body.stream,
                                 echo=body.echo, logprobs=logprobs,
                                 request_id=rid and (rid if len(prompts) == 1 else f"{rid}-{i}"))
                 for i, p in enumerate(prompts)]
    gateway = request.app.state.gateway
    n = body.n
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": adapter or model.name, "system_fingerprint": _fingerprint(model.name)}
    if body.stream:
        chunks = await unless_disconnected(request, lambda: first_and_rest(
            merged(gateway, generates)))
        return sse_response(_completion_events(chunks, head, body, n))
    results = await unless_disconnected(request, lambda: collect(gateway, generates))
    choices = [_completion_choice(prompt_index * n + i, seq, result, body)
               for prompt_index, result in enumerate(results)
               for i, seq in enumerate(result.sequences)]
    usage = _usage(sum(r.num_input_tokens for r in results),
                   sum(r.num_output_tokens for r in results))
    return JSONResponse({**head, "object": "text_completion", "choices": choices, "usage": usage})


def _completion_choice(index: int, seq: SequenceResult, result: GenerationResult,
                       body: CompletionRequest) -> dict:
    logprobs = None
    if body.logprobs is not None:
        entries = (result.prompt_logprobs or []) if body.echo else []
        logprobs = completion_logprobs(entries + seq.logprobs)
    return {"index": index, "text": seq.text, "logprobs": logprobs,
            "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}


async def _completion_events(chunks, head: dict, body: CompletionRequest, n: int):
    head = {**head, "object": "text_completion"}
    extra = {"usage": None} if body.include_usage else {}
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    offsets: dict[int, int] = {}  # text sent so far per choice, for text_offset
    try:
        async for prompt_index, chunk in chunks:
            if chunk.num_input_tokens is not None:
                prompt_tokens[prompt_index] = chunk.num_input_tokens
            for seq in chunk.sequences:
                completion_tokens += len(seq.token_ids)
                if not (seq.text or seq.finish_reason or seq.token_ids):
                    continue
                index = prompt_index * n + seq.index
                logprobs = None
                if body.logprobs is not None:
                    echoed = (chunk.prompt_logprobs or []) if body.echo else []
                    logprobs = completion_logprobs(echoed + seq.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(seq.text)
                yield sse_event({**head, **extra, "choices": [{
                    "index": index, "text": seq.text, "logprobs": logprobs,
                    "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}]})
        if body.include_usage:
            yield sse_event({**head, "choices": [], "usage": _usage(sum(prompt_tokens.values()),
                                                                    completion_tokens)})
    except APIError as error:
        yield sse_event({"error": {"message": error.message, "type": error.kind,
                                   "param": error.param, "code": error.status}})
    yield sse_event("[DONE]")
