"""tritonlm-serve's command line, error paths and shutdown."""
import queue
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from conftest import linked_repository
from tritonlm.ports import free_ports
from tritonlm.serve import KILL_GRACE, build_command, exit_timeout
from tritonlm_client.grpc_client import infer_input
from tritonlm_client._core import request_fields
from triton_server import SERVE, ServerStartError, start_server

BAD_CONFIG = """name: "bad"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.fixture
def bad_repo(tmp_path):
    (tmp_path / "bad" / "1").mkdir(parents=True)
    (tmp_path / "bad" / "config.pbtxt").write_text(BAD_CONFIG)
    (tmp_path / "bad" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('tritonlm-test: weights missing')\n")
    return tmp_path


def test_build_command(tmp_path):
    argv, env = build_command(tmp_path, http_port=1, grpc_port=2, metrics_port=3, extra_args=["--foo=1"])
    backend_dir = Path(next(a for a in argv if a.startswith("--backend-directory=")).split("=", 1)[1])
    assert (backend_dir / "python" / "triton_python_backend_stub").exists()
    assert (backend_dir / "python" / "libtriton_python.so").exists()
    assert f"--model-repository={tmp_path.resolve()}" in argv and "--http-port=1" in argv
    assert argv[-1] == "--foo=1"
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert env["LD_LIBRARY_PATH"].split(":")[0].endswith("nvidia_pytriton.libs")


def test_exit_timeout_is_read_from_tritonservers_arguments():
    assert exit_timeout([]) == 30
    assert exit_timeout(["--exit-timeout-secs=4", "--log-info=1"]) == 4
    assert exit_timeout(["--exit-timeout-secs", "7"]) == 7


def test_missing_repository_is_a_clear_error(tmp_path):
    proc = subprocess.run([str(SERVE), "--model-repository", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "not a directory" in proc.stderr


@pytest.mark.server
def test_model_that_fails_to_load_stops_the_server(bad_repo):
    with pytest.raises(ServerStartError) as err:
        with start_server(bad_repo, timeout=120):
            pass
    message = str(err.value)
    assert "exited with code" in message and "before ready" in message
    assert "tritonlm-test: weights missing" in message


@pytest.mark.server
def test_a_stub_under_numpy_2_refuses_the_model_before_any_request(smollm2_repo, tmp_path):
    """tritonserver 2.51's backend stub builds numpy arrays through a pybind11 older than NumPy 2:
    under NumPy 2 the first request's string input killed the stub (seen on a GPU machine)."""
    numpy2 = Path(sys.prefix) / "numpy2"  # tools/setup.sh installs NumPy 2 there
    assert (numpy2 / "numpy").is_dir(), "run make setup"
    venv = tmp_path / "venv"  # this venv's packages behind NumPy 2
    subprocess.run([f"{sys.base_prefix}/bin/python{sys.version_info.major}.{sys.version_info.minor}",
                    "-m", "venv", "--without-pip", str(venv)], check=True)
    (Path(site.getsitepackages([str(venv)])[0]) / "numpy2-first.pth").write_text(
        f"import site, sys; sys.path.insert(0, {str(numpy2)!r}); "
        f"site.addsitedir({site.getsitepackages()[0]!r})\n")
    repo = linked_repository(smollm2_repo, tmp_path / "repo", num_kv_blocks=16)
    http, grpc_port, metrics = free_ports(3)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "tritonlm.serve", "--model-repository",
                           str(repo), "--no-frontend", "--http-port", str(http), "--grpc-port",
                           str(grpc_port), "--metrics-port", str(metrics)],
                          capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "reads tensors wrongly under NumPy 2." in output and "install numpy<2" in output, \
        output[-3000:]


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.server
def test_sigterm_stops_the_server_while_a_client_holds_a_stream_open(smollm2_repo, tmp_path):
    """tritonserver alone never exits while a gRPC stream stays open, even an idle one."""
    repo = linked_repository(smollm2_repo, tmp_path / "repo", num_kv_blocks=64, max_model_len=256)
    with start_server(repo, extra_args=("--exit-timeout-secs=2",)) as server:
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        fields = request_fields([1, 2, 3], stream=True, sampling={"max_tokens": 2})
        client.async_stream_infer("llm", [infer_input(n, v) for n, v in fields.items()])
        for _ in range(2):
            result, error = responses.get(timeout=60)
            assert error is None
        launched = _children(server.process.pid)
        processes = launched + [c for pid in launched for c in _children(pid)]
        assert len(processes) == 3  # tritonserver, its backend stub and the HTTP front end
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=2 + KILL_GRACE + 30)
        client.close()
    deadline = time.monotonic() + 10  # a killed process takes a moment to be torn down
    while (running := [pid for pid in processes if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running, server.logs()[-3000:]
