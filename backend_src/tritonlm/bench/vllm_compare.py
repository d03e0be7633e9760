"""vLLM's CPU build on the same requests: it lives in its own virtual environment
(`make setup-vllm` makes .venv-vllm), so its runner runs there as a subprocess, started once and
kept waiting between timed runs so that they alternate with the other systems' runs."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tritonlm.bench.workloads import BenchRequest
from tritonlm.config import WEIGHTS_DIR
from tritonlm.engine.llm_engine import resolve_model_dir

RUNNER = Path(__file__).with_name("vllm_runner.py")
_PROJECT_ROOT = Path(__file__).resolve().parents[3]
# vllm_runner.py's line prefixes (it must not import tritonlm, nor we it).
_READY, _ROUND = "vllm_runner ready ", "vllm_runner round "


def vllm_python() -> Path:
    """The interpreter of vLLM's environment: $TRITONLM_VLLM_PYTHON or the project's .venv-vllm."""
    python = Path(os.environ.get("TRITONLM_VLLM_PYTHON", _PROJECT_ROOT / ".venv-vllm/bin/python"))
    if not python.exists():
        raise FileNotFoundError(f"no vLLM environment at {python}: run `make setup-vllm` "
                                "or set TRITONLM_VLLM_PYTHON")
    return python


class VllmProcess:
    """vLLM started (model loaded, compiled, warmed up) on `requests`; each `run()` times one
    offline generate of them all; `close()` stops it, `kill()` after a failure."""

    def __init__(self, model_dir: Path, requests: list[BenchRequest], dtype: str,
                 max_model_len: int, kv_cache_gib: float):
        python = vllm_python()
        self.tmp = tempfile.TemporaryDirectory()
        tmp = Path(self.tmp.name)
        weights = resolve_model_dir(model_dir) / WEIGHTS_DIR
        subprocess.run([str(python), str(RUNNER), "--prepare-hf-dir", str(weights),
                        str(tmp / "hf")], check=True, stdout=subprocess.DEVNULL)
        (tmp / "requests.json").write_text(json.dumps(
            [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.output_len}
             for r in requests]))
        self.process = subprocess.Popen(
            [str(python), str(RUNNER), "--model", str(tmp / "hf"),
             "--requests", str(tmp / "requests.json"), "--output", str(tmp / "results.json"),
             "--dtype", dtype, "--max-model-len", str(max_model_len),
             "--kv-cache-gib", str(kv_cache_gib), "--rounds-on-stdin", "--quiet"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ready = self._line(_READY)
        except BaseException:
            self.kill()
            raise
        self.version, self.settings = ready["vllm_version"], ready["settings"]

    def _line(self, prefix: str) -> dict:
        """The next line starting with `prefix`, as JSON; vLLM's own output passes to stderr."""
        for line in self.process.stdout:
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
            sys.stderr.write(line)
        raise RuntimeError(f"vllm_runner exited ({self.process.wait()}) before "
                           f"'{prefix.strip()}'")

    def run(self) -> dict:
        """{"elapsed_s", "output_tokens"} of one timed generate."""
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return self._line(_ROUND)

    def close(self) -> dict:
        """Stops the runner; returns its results file (settings with every run's CPU figures)."""
        self.process.stdin.close()
        for line in self.process.stdout:
            sys.stderr.write(line)
        if self.process.wait() != 0:
            raise RuntimeError(f"vllm_runner failed with exit code {self.process.returncode}")
        results = json.loads((Path(self.tmp.name) / "results.json").read_text())
        self.tmp.cleanup()
        return results

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.tmp.cleanup()
