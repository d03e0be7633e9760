"""`tritonlm-frontend --triton-url A --triton-url B`: two real tritonservers behind one front end,
driven with the openai SDK; which replica served what is read from Triton's own statistics."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from family_check import tiny_llama
from triton_server import start_server
from tritonlm.ports import free_ports

FRONTEND = Path(sys.executable).parent / "tritonlm-frontend"
SHARED_PREFIX = "You are a terse assistant for a shipping company. " * 8  # > 256 characters


def served_count(server) -> int:
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/llm/stats", timeout=10) as response:
        return json.load(response)["model_stats"][0]["inference_stats"]["success"]["count"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, smollm2_tokenizer):
    tmp = tmp_path_factory.mktemp("replicas")
    _, model_dir = tiny_llama(tmp, smollm2_tokenizer)
    with start_server(model_dir.parent) as a, start_server(model_dir.parent) as b:
        port = free_ports(1)[0]
        log = open(tmp / "frontend.log", "wb")
        frontend = subprocess.Popen([str(FRONTEND), "--triton-url", a.grpc_url, "--triton-url", b.grpc_url,
                                     "--host", "127.0.0.1", "--port", str(port),
                                     "--model-repository", str(model_dir.parent)],
                                    stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.25)
            yield a, b, url
        finally:
            frontend.terminate()
            frontend.wait(30)
            log.close()


def complete(url: str, prompt: str, max_tokens: int = 8) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    return client.completions.create(model="llm", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_requests_spread_over_replicas_and_prefixes_stay_together(replicas):
    a, b, url = replicas
    before = served_count(a), served_count(b)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: complete(url, f"request {i}: tell me about ships", 24), range(8)))
    spread = served_count(a) - before[0], served_count(b) - before[1]
    assert sum(spread) == 8 and min(spread) >= 2, spread  # the least busy replica gets each

    before = served_count(a), served_count(b)
    texts = [complete(url, SHARED_PREFIX + f"Question {i}?") for i in range(6)]
    together = served_count(a) - before[0], served_count(b) - before[1]
    assert sorted(together) == [0, 6], together  # one prefix, one replica's prefix cache
    assert all(isinstance(text, str) for text in texts)


def test_a_dead_replica_loses_no_request_that_had_not_started(replicas):
    a, b, url = replicas
    before = served_count(a), served_count(b)
    complete(url, SHARED_PREFIX + "Which replica?")
    pinned, other = (a, b) if served_count(a) > before[0] else (b, a)
    # a stream on the pinned replica (same prefix), which dies while it generates
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{url}/v1/completions", json={
                "model": "llm", "prompt": SHARED_PREFIX + "Tell a long story.", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}) as stream:
            events = stream.iter_lines()
            assert next(line for line in events if line.startswith("data:"))
            os.killpg(pinned.process.pid, signal.SIGKILL)
            rest = [line for line in events if line.startswith("data:")]
    assert any('"error"' in line for line in rest), rest[-3:]  # the started stream ends with an error
    # requests not yet started go to the replica still up, the prefix's included
    served = served_count(other)
    texts = [complete(url, SHARED_PREFIX + f"After {i}?") for i in range(3)]
    texts += [complete(url, f"fresh {i}") for i in range(3)]
    assert len(texts) == 6 and served_count(other) == served + 6
    assert httpx.get(f"{url}/health").status_code == 200
