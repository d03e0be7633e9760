"""The model's watch on its tritonserver: the endpoint it asks about readiness, read from the
server's command line as tritonserver parses it, and the reaper that kills a backend stub whose
tritonserver is gone (on stand-in processes)."""
import subprocess
import sys
import time

import pytest

from tritonlm.interpreter import python_executable
from tritonlm.triton.server_watch import server_http_url


@pytest.mark.parametrize("argv, url", [
    (["tritonserver", "--model-repository=/m"], "http://127.0.0.1:8000"),
    (["tritonserver", "--model-repository", "/m", "--http-port", "9100"], "http://127.0.0.1:9100"),
    (["tritonserver", "--http-port=9100", "--http-address=10.1.2.3"], "http://10.1.2.3:9100"),
    (["tritonserver", "--http-address=::", "--grpc-port=9001"], "http://[::1]:8000"),
    (["tritonserver", "--allow-http=false", "--http-port=9100"], None),
    (["tritonserver", "--allow-http", "0"], None),
])
def test_the_http_endpoint_from_a_command_line(argv, url):
    assert server_http_url(argv) == url


@pytest.fixture
def sleepers():
    processes = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def start_reaper(server, stub) -> subprocess.Popen:
    reaper = subprocess.Popen([python_executable(), "-m", "tritonlm.triton.stub_reaper",
                               str(server.pid), str(stub.pid)], stderr=subprocess.PIPE, text=True)
    time.sleep(1)  # waiting on both
    assert reaper.poll() is None
    return reaper


def test_the_server_killed_kills_the_stub(sleepers):
    server, stub = sleepers
    reaper = start_reaper(server, stub)
    server.kill()  # not reaped yet: a zombie counts as gone
    assert stub.wait(10) == -9
    assert reaper.wait(10) == 0
    assert f"tritonserver (pid {server.pid}) is gone" in reaper.stderr.read()


def test_the_stub_ending_first_ends_the_reaper_and_spares_the_server(sleepers):
    server, stub = sleepers
    reaper = start_reaper(server, stub)
    stub.terminate()
    stub.wait()
    assert reaper.wait(10) == 0
    assert server.poll() is None and reaper.stderr.read() == ""


def test_a_server_already_gone_kills_the_stub_at_once(sleepers):
    server, stub = sleepers
    server.kill()
    server.wait()
    subprocess.run([sys.executable, "-m", "tritonlm.triton.stub_reaper", str(server.pid),
                    str(stub.pid)], check=True, capture_output=True, timeout=10)
    assert stub.wait(10) == -9
