"""`tritonlm-frontend`: the OpenAI and TGI HTTP APIs and a chat page in front of a running
tritonserver that serves tritonlm models."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from .app import FrontendSettings, create_app
from .replica_pool import ROUTINGS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonlm-frontend", description=__doc__.splitlines()[0])
    parser.add_argument("--triton-url", action="append",
                        help="tritonserver's gRPC endpoint (default localhost:8001); repeated: "
                             "replicas serving the same repository, requests spread over them")
    parser.add_argument("--routing", choices=ROUTINGS, default="prefix-affinity",
                        help="over several --triton-url replicas: the least busy one with affinity "
                             "for shared prompt prefixes (default), or round-robin")
    parser.add_argument("--triton-metrics-url", default=None,
                        help="tritonserver's metrics URL, appended to /metrics (default: the "
                             "--triton-url host, port 8002)")
    parser.add_argument("--model-repository", type=Path,
                        help="the served repository, read for tokenizers (/tokenize)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--log-level", default="info")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    urls = args.triton_url or ["localhost:8001"]
    metrics_url = args.triton_metrics_url
    if metrics_url is None:
        metrics_url = f"http://{urls[0].rsplit(':', 1)[0]}:8002/metrics"
    app = create_app(FrontendSettings(urls, metrics_url, args.model_repository, args.routing))
    # One worker: its event loop multiplexes every request; the engine does the heavy work.
    # uvicorn[standard] gives it uvloop and httptools: on 2 shared cores, a token's SSE event
    # costs the engine less CPU (TGI route at concurrency 32: 0.86x -> 1.03x of gRPC's tokens/s).
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=False, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
