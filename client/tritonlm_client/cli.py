"""`tritonlm-client`: generate text or chat with a tritonlm model from the command line."""
from __future__ import annotations

import argparse
import sys
from typing import Iterator

from ._core import Delta, TritonLMError
from .chat_defaults import chat_settings


def _sampling(args) -> dict:
    keys = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def _chat_sampling(client, args, show: bool) -> dict:
    """The keys to send for a chat: the user's, and the chat defaults for keys neither the user
    nor the model sets (the server applies the model's own defaults to the keys left unset).
    With `show`, prints the settings in use once (stderr)."""
    given = _sampling(args)
    try:
        model = client.sampling_defaults()
    except TritonLMError:
        model = {}  # the requests themselves will say what is wrong
    in_use = {**chat_settings(model), **given}
    if show:
        groups = {"given": [k for k in in_use if k in given],
                  "the model's": [k for k in in_use if k not in given and k in model],
                  "chat defaults": [k for k in in_use if k not in given and k not in model]}
        print("[settings: " + "; ".join(
            " ".join(f"{k}={in_use[k]}" for k in keys) + f" ({label})"
            for label, keys in groups.items() if keys) + "]", file=sys.stderr, flush=True)
    return {k: v for k, v in in_use.items() if k in given or k not in model}


def _client(args):
    if args.openai:
        from .openai_client import OpenAIClient
        return OpenAIClient(args.openai, args.model, timeout=args.timeout)
    if args.http:
        from .http_client import HTTPClient
        return HTTPClient(args.url or "localhost:8000", args.model, timeout=args.timeout)
    from .grpc_client import Client
    return Client(args.url or "localhost:8001", args.model, timeout=args.timeout)


def _print_stream(deltas: Iterator[Delta], out=sys.stdout) -> tuple[str, str | None]:
    """Echo deltas as they arrive; returns the whole text and the finish reason."""
    text, reason = [], None
    for delta in deltas:
        out.write(delta.text)
        out.flush()
        text.append(delta.text)
        reason = delta.finish_reason or reason
    return "".join(text), reason


def _generate(args) -> int:
    client = _client(args)
    if args.chat:
        sampling = _chat_sampling(client, args, show=args.verbose)
        prompt, stream, whole = ([{"role": "user", "content": args.prompt}], client.chat_stream,
                                 client.chat)
    else:
        sampling = _sampling(args)
        prompt, stream, whole = args.prompt, client.stream, client.generate
    if args.stream:
        _, reason = _print_stream(stream(prompt, **sampling))
        print()
    else:
        result = whole(prompt, **sampling)
        print(result.text)
        reason = result.finish_reason
        if args.verbose:
            print(f"[input tokens: {result.num_input_tokens}, output tokens: {result.num_output_tokens}]",
                  file=sys.stderr)
    if args.verbose:
        print(f"[finish reason: {reason}]", file=sys.stderr)
    return 0


def _chat(args) -> int:
    client = _client(args)
    sampling = _chat_sampling(client, args, show=True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        deltas = client.chat_stream(messages, **sampling)
        try:
            answer, _ = _print_stream(deltas)
        except (KeyboardInterrupt, TritonLMError) as err:  # drop this turn, keep the conversation
            deltas.close()  # cancels the request if it is still running
            messages.pop()
            print(f"\n[{'interrupted' if isinstance(err, KeyboardInterrupt) else f'error: {err}'}]",
                  file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": answer})


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="server address (default localhost:8001, or localhost:8000 with --http)")
    common.add_argument("--model", default="llm", help="model name (default: llm)")
    transport = common.add_mutually_exclusive_group()
    transport.add_argument("--http", action="store_true", help="use HTTP generate instead of gRPC")
    transport.add_argument("--openai", metavar="URL",
                           help="go through the HTTP front end's OpenAI API at URL (e.g. "
                                "http://localhost:8080) instead of Triton's endpoints")
    common.add_argument("--timeout", type=float, help="request timeout in seconds")
    common.add_argument("--max-tokens", dest="max_tokens", type=int)
    common.add_argument("--temperature", type=float)
    common.add_argument("--top-k", dest="top_k", type=int)
    common.add_argument("--top-p", dest="top_p", type=float)
    common.add_argument("--seed", type=int)
    common.add_argument("--stop", action="append", metavar="S", help="stop string (repeatable)")
    common.add_argument("-v", "--verbose", action="store_true", help="print finish reason and token counts")
    parser = argparse.ArgumentParser(prog="tritonlm-client", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[common], help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as one user chat message (the model's chat template), "
                          "starting from the chat settings")
    gen.set_defaults(run=_generate)
    chat = sub.add_parser("chat", parents=[common], help="interactive chat (reads user turns from "
                          "stdin); sampling keys left unset start from the model's defaults, "
                          "else from chat defaults (printed at start)")
    chat.add_argument("--system", help="system prompt")
    chat.set_defaults(run=_chat)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except TritonLMError as err:
        print(f"tritonlm-client: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
