"""Stopping, killing or unloading the model while a long generation streams: the request ends with
a clear error at once, tritonserver exits with its backend stub (no orphan still generating), an
unloaded model loads and a restarted server serves again."""
import contextlib
import json
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest

from conftest import linked_repository
from test_server import grpc_stream, http_post, text_of
from triton_server import _ready, start_server
from tritonlm.ports import free_ports
from tritonlm.serve import build_command
from tritonlm.triton.contract import EXPLICIT_CONTROL_VARIABLE

pytestmark = pytest.mark.server
LONG = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}  # a minute or more here
EXIT_TIMEOUT = 30


def streaming(url: str) -> tuple[threading.Thread, dict]:
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=grpc_stream(url, "Tell me a story.", LONG)),
                              daemon=True)
    worker.start()
    time.sleep(4)  # loaded, prefilled, streaming tokens
    return worker, result


def stubs_of(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid), "-f", "triton_python_backend_stub"],
                           capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def alive(pid: int) -> bool:
    return subprocess.run(["ps", "-p", str(pid), "-o", "stat="], capture_output=True,
                          text=True).stdout.strip() not in ("", "Z")


@contextlib.contextmanager
def plain_tritonserver(repo, log_path):
    """tritonserver as a user runs it, without tritonlm-serve: (process, http, grpc) once ready."""
    http, grpc, metrics = free_ports(3)
    argv, env = build_command(repo, http, grpc, metrics,
                              extra_args=[f"--exit-timeout-secs={EXIT_TIMEOUT}"])
    env.pop(EXPLICIT_CONTROL_VARIABLE)
    argv = [a for a in argv if not a.startswith(("--model-control-mode", "--load-model"))]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _ready(f"127.0.0.1:{http}"):
            assert server.poll() is None and time.monotonic() < deadline, (
                log_path.read_text()[-3000:])
            time.sleep(0.25)
        yield server, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def wait_gone(pids: list[int], seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(alive(pid) for pid in pids)


def test_sigterm_to_a_plain_tritonserver_ends_the_stream_and_the_stub(smollm2_repo, tmp_path):
    with plain_tritonserver(smollm2_repo.parent, tmp_path / "server.log") as (server, _, grpc):
        stubs = stubs_of(server.pid)
        assert stubs
        worker, result = streaming(grpc)
        server.terminate()
        server.wait(EXIT_TIMEOUT - 10)  # not its exit timeout: nothing keeps it waiting
        worker.join(30)
        results, error = result["out"]
        assert results and "the model is being unloaded" in str(error)
        assert wait_gone(stubs)


def test_sigkill_to_tritonserver_fails_the_stream_leaves_no_stub_and_a_restart_serves(
        smollm2_repo, tmp_path):
    """tritonserver killed outright (no unload, no finalize): the client's stream fails, the
    stub sees its parent gone and exits, and a new server on the same repository serves."""
    with plain_tritonserver(smollm2_repo.parent, tmp_path / "first.log") as (server, _, grpc):
        stubs = stubs_of(server.pid)
        worker, result = streaming(grpc)
        server.kill()
        server.wait()
        worker.join(30)
        assert not worker.is_alive()
        results, error = result["out"]
        assert results and error is not None
        assert wait_gone(stubs)
    with plain_tritonserver(smollm2_repo.parent, tmp_path / "second.log") as (_, _, grpc):
        results, error = grpc_stream(grpc, "Hi", {"max_tokens": 4}, stream=False)
        assert error is None and text_of(results[-1])


def test_unloading_under_load_ends_the_stream_and_the_model_loads_again(smollm2_repo):
    with start_server(smollm2_repo.parent) as server:
        worker, result = streaming(server.grpc_url)
        status, body = http_post(server.http_url, "/v2/repository/models/llm/unload", {})
        assert status == 200, body
        worker.join(30)
        results, error = result["out"]
        assert results and "the model is being unloaded" in str(error)
        deadline = time.monotonic() + 30
        while urllib.request.urlopen(f"http://{server.http_url}/v2/repository/index",
                                     data=b"{}").read().find(b'"UNAVAILABLE"') < 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        status, body = http_post(server.http_url, "/v2/repository/models/llm/load", {})
        assert status == 200, body
        results, error = grpc_stream(server.grpc_url, "Hi", {"temperature": 0, "max_tokens": 4},
                                     stream=False)
        assert error is None and text_of(results[-1])


def test_a_new_version_loaded_while_streaming_takes_over_and_the_old_one_finishes(smollm2_repo,
                                                                                   tmp_path):
    """A newer version added to the repository and loaded while version 1 streams: the stream
    finishes whole (version 1 drains, then unloads), new requests go to version 2, and both
    versions give the same greedy tokens."""
    repo = linked_repository(smollm2_repo, tmp_path / "repo", num_kv_blocks=64)
    sampling = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
    with start_server(repo) as server:
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(out=grpc_stream(
            server.grpc_url, "Tell me a story.", sampling)), daemon=True)
        worker.start()
        time.sleep(3)
        shutil.copytree(repo / "llm" / "1", repo / "llm" / "2", symlinks=True)
        status, body = http_post(server.http_url, "/v2/repository/models/llm/load", {})
        assert status == 200, body
        worker.join(300)
        old, error = result["out"]
        assert error is None and sum(len(r.as_numpy("token_ids")) for r in old) == 200
        deadline = time.monotonic() + 60
        while True:  # version 1 unloads once its last response went
            index = json.loads(urllib.request.urlopen(
                f"http://{server.http_url}/v2/repository/index", data=b"{}").read())
            states = {entry["version"]: entry["state"] for entry in index}
            if states.get("1", "UNAVAILABLE") == "UNAVAILABLE":
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.2)
        assert states["2"] == "READY"
        new, error = grpc_stream(server.grpc_url, "Tell me a story.", sampling)
        assert error is None
        assert [t for r in new for t in r.as_numpy("token_ids")] == [
            t for r in old for t in r.as_numpy("token_ids")]
