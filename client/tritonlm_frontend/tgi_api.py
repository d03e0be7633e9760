"""TGI's API as its router serves it: POST /generate, /generate_stream and / (compat), GET /info,
POST /tokenize; errors as {"error", "error_type"} with TGI's statuses."""
from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .errors import APIError
from .generations import SequenceResult, clamped_logprob, collect, first_and_rest, merged
from .http_utils import read_body, request_id, sse_event, sse_response, unless_disconnected
from .served_models import REQUEST_LIMITS, ServedModel
from .tgi_protocol import CompatBody, GenerateBody, GenerateParameters
from .triton_gateway import GenerateRequest, SequenceDelta

router = APIRouter()

_ERROR_TYPES = {400: "validation", 422: "validation", 424: "generation", 429: "overloaded",
                500: "incomplete_generation", 404: "not_found", 501: "not_implemented",
                503: "unhealthy"}
# The gateway's statuses as TGI's router reports the same causes: a request the engine rejects
# is a validation error, an engine failure a generation error, a cut stream an incomplete one.
_TGI_STATUS = {400: 422, 500: 424, 502: 500}


def error_type(error: APIError) -> str:
    return _ERROR_TYPES.get(error.status, "generation")


def tgi_error(error: APIError) -> APIError:
    status = _TGI_STATUS.get(error.status, error.status)
    return error if status == error.status else APIError(status, error.message, error.param)


def _error_event(error: APIError) -> str:
    error = tgi_error(error)
    return sse_event({"error": error.message, "error_type": error_type(error)})


async def _prepare(request: Request, body: GenerateBody, stream: bool) -> GenerateRequest:
    """The Triton request for a TGI body, after TGI's validation (its context checks need the
    model's tokenizer; without one the engine's own checks remain)."""
    model = await request.app.state.catalog.get(None)
    body.check(stream, model.limits)
    params = body.parameters
    if model.max_model_len:
        tokens = len(model.tokenizer.encode(body.inputs).ids) if model.tokenizer else None
        params.check_length(tokens, model.max_model_len)
    sampling = params.engine_sampling(token_details=stream or params.wants_details)
    return GenerateRequest(model.name, prompt=body.inputs, sampling=sampling, stream=stream,
                           logprobs="logprobs" in sampling, request_id=request_id(request))


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str:
    """TGI's finish_reason for the engine's finish_reason and stop_reason."""
    if reason == "stop":
        return "eos_token" if stop_reason is None else "stop_sequence"
    return "length"  # "length" (or "abort", which TGI has no name for)


def _token(entry: dict, text: str | None = None) -> dict:
    return {"id": entry["token_id"], "text": entry["token"] if text is None else text,
            "logprob": clamped_logprob(entry["logprob"]), "special": entry["special"]}


def _seed(params: GenerateParameters, sampling: dict) -> int | None:
    return sampling.get("seed") if params.sampling else None


def _sequence_details(seq: SequenceResult, params: GenerateParameters, seed: int | None,
                      prefill: list[dict]) -> dict:
    details = {"finish_reason": finish_reason(seq.finish_reason, seq.stop_reason),
               "generated_tokens": len(seq.token_ids), "seed": seed, "prefill": prefill,
               "tokens": [_token(e) for e in seq.logprobs]}
    if params.top_n_tokens:
        details["top_tokens"] = [[_token(t) for t in e["top_logprobs"]] for e in seq.logprobs]
    return details


async def _generate(request: Request, body: GenerateBody) -> dict:
    try:
        generate = await _prepare(request, body, stream=False)
        result, = await unless_disconnected(
            request, lambda: collect(request.app.state.gateway, [generate]))
    except APIError as error:
        raise tgi_error(error) from None
    params = body.parameters
    prefix = body.inputs if params.return_full_text else ""
    # best_of: the sequence with the highest cumulative logprob answers, the others follow
    ranked = sorted(result.sequences, key=lambda s: -(s.cumulative_logprob or 0.0))
    best = ranked[0]
    response = {"generated_text": prefix + best.text}
    if params.wants_details:
        seed = _seed(params, generate.sampling)
        prefill = [{"id": e["token_id"], "text": e["token"],
                    "logprob": clamped_logprob(e["logprob"])}
                   for e in result.prompt_logprobs or []] if params.decoder_input_details else []
        details = _sequence_details(best, params, seed, prefill)
        if len(ranked) > 1:
            details["best_of_sequences"] = [
                {"generated_text": prefix + s.text, **_sequence_details(s, params, seed, prefill)}
                for s in ranked[1:]]
        response["details"] = details
    return response


async def _generate_stream(request: Request, body: GenerateBody):
    try:
        generate = await _prepare(request, body, stream=True)
        chunks = await unless_disconnected(request, lambda: first_and_rest(
            merged(request.app.state.gateway, [generate])))
    except APIError as error:
        raise tgi_error(error) from None
    return sse_response(_stream_events(chunks, body, _seed(body.parameters, generate.sampling)))


def _token_texts(delta: SequenceDelta) -> list[str]:
    """Each token's share of the delta's text: its own text while the delta's text goes on with
    it, and the rest to the delta's last token (a character split over byte tokens, held-back
    stop-string text), so that the tokens' texts add up to the text."""
    rest, texts = delta.text, []
    entries = delta.logprobs
    last = max((i for i, e in enumerate(entries) if not e["special"]), default=len(entries) - 1)
    for i, entry in enumerate(entries):
        if i == last:
            texts.append(rest or entry["token"] if entry["special"] else rest)
            rest = ""
        elif entry["special"]:
            texts.append(entry["token"])
        elif entry["token"] and rest.startswith(entry["token"]):
            texts.append(entry["token"])
            rest = rest[len(entry["token"]):]
        else:
            texts.append("")
    return texts


async def _stream_events(chunks, body: GenerateBody, seed: int | None):
    """One event per token; the last carries generated_text (and details when asked for)."""
    params = body.parameters
    text = body.inputs if params.return_full_text else ""
    index, generated, input_length, last = 0, 0, 0, None
    try:
        async for _, chunk in chunks:
            input_length = chunk.num_input_tokens or input_length
            for delta in chunk.sequences:
                text += delta.text
                generated += len(delta.token_ids)
                entries = list(zip(delta.logprobs, _token_texts(delta)))
                if delta.finish_reason and not entries and last is not None:
                    entries = [({**last, "special": True}, "")]  # an end without a new token
                for position, (entry, piece) in enumerate(entries):
                    index += 1
                    last = entry
                    event = {"index": index, "token": _token(entry, piece)}
                    if params.top_n_tokens:
                        event["top_tokens"] = [_token(t) for t in entry["top_logprobs"]]
                    end = delta.finish_reason is not None and position == len(entries) - 1
                    event["generated_text"] = text if end else None
                    event["details"] = {
                        "finish_reason": finish_reason(delta.finish_reason, delta.stop_reason),
                        "generated_tokens": generated, "seed": seed, "input_length": input_length,
                    } if end and params.details else None
                    yield sse_event(event)
    except APIError as error:
        yield _error_event(error)


@router.post("/generate")
async def generate(request: Request):
    body = await read_body(request, GenerateBody, status=422)
    return JSONResponse(await _generate(request, body))


@router.post("/generate_stream")
async def generate_stream(request: Request):
    body = await read_body(request, GenerateBody, status=422)
    return await _generate_stream(request, body)


@router.post("/")
async def compat_generate(request: Request):
    """TGI's compat route: the stream when `stream`, else a list of one response (the
    `text-generation` client reads it so). The full text is returned unless asked otherwise,
    as TGI does for text-generation models."""
    body = await read_body(request, CompatBody, status=422)
    if body.parameters.return_full_text is None:
        body.parameters.return_full_text = True
    if body.stream:
        return await _generate_stream(request, body)
    return JSONResponse([await _generate(request, body)])


@router.get("/info")
async def info(request: Request):
    model: ServedModel = await request.app.state.catalog.get(None)
    max_total = model.max_model_len
    # as the engine loaded it ("auto" settled, engine.json edited), else the converter's
    loaded = await request.app.state.metrics.engine_settings(model.name)
    dtype = loaded.get("dtype", model.parameters.get("dtype"))
    return {
        "model_id": model.name, "model_sha": None, "model_pipeline_tag": "text-generation",
        "model_dtype": dtype, "model_device_type": model.device_type,
        **{name: _limit(loaded, name, model.limits.get(name)) for name in REQUEST_LIMITS},
        "max_input_tokens": _limit(loaded, "max_input_tokens", max_total - 1 if max_total else None),
        "max_total_tokens": _limit(loaded, "max_total_tokens", max_total),
        "validation_workers": 1, "max_client_batch_size": 1,
        "router": "tritonlm", "version": _version(), "sha": None, "docker_label": None,
        "sampling_defaults": model.sampling_defaults,
        "speculate": int(loaded.get("speculate", 0)),  # tokens proposed per step
    }


def _limit(loaded: dict[str, str], name: str, fallback: int | None) -> int | None:
    """An engine limit as the engine loaded it, else what the model's config implies."""
    return int(loaded[name]) if name in loaded else fallback


def _version() -> str:
    try:
        return metadata.version("tritonlm")
    except metadata.PackageNotFoundError:
        return "unknown"


@router.post("/tokenize")
async def tokenize(request: Request):
    """The prompt's tokens with their character offsets (special tokens added as the model
    adds them; `parameters.truncate` keeps the last N)."""
    body = await read_body(request, GenerateBody, status=422)
    model = await request.app.state.catalog.get(None)
    encoding = model.require_tokenizer().encode(body.inputs)
    tokens = [{"id": token_id, "text": body.inputs[start:stop], "start": start, "stop": stop}
              for token_id, (start, stop) in zip(encoding.ids, encoding.offsets)]
    truncate = body.parameters.truncate
    return tokens[-truncate:] if truncate and truncate > 0 else tokens
