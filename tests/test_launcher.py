"""tritonlm-serve's error paths and command line; none needs a working model."""
import subprocess
import sys
from pathlib import Path

import pytest

from tritonlm.serve import build_command
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
