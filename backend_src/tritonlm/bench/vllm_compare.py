"""vLLM's CPU build on the same requests: it lives in its own virtual environment
(`make setup-vllm` makes .venv-vllm), so it runs there as a subprocess over JSON files."""
import json
import os
import subprocess
import tempfile
from pathlib import Path

from tritonlm.bench.workloads import BenchRequest
from tritonlm.config import WEIGHTS_DIR
from tritonlm.engine.llm_engine import resolve_model_dir

RUNNER = Path(__file__).with_name("vllm_runner.py")
_PROJECT_ROOT = Path(__file__).resolve().parents[3]


def vllm_python() -> Path:
    """The interpreter of vLLM's environment: $TRITONLM_VLLM_PYTHON or the project's .venv-vllm."""
    python = Path(os.environ.get("TRITONLM_VLLM_PYTHON", _PROJECT_ROOT / ".venv-vllm/bin/python"))
    if not python.exists():
        raise FileNotFoundError(f"no vLLM environment at {python}: run `make setup-vllm` "
                                "or set TRITONLM_VLLM_PYTHON")
    return python


def run_vllm(model_dir: Path, requests: list[BenchRequest], dtype: str, max_model_len: int,
             kv_cache_gib: float) -> dict:
    """vLLM's offline throughput: {"output_tokens_per_s", "elapsed_s", "output_tokens", ...}."""
    python = vllm_python()
    weights = resolve_model_dir(model_dir) / WEIGHTS_DIR
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = tmp / "hf"
        subprocess.run([str(python), str(RUNNER), "--prepare-hf-dir", str(weights), str(hf_dir)],
                       check=True)
        (tmp / "requests.json").write_text(json.dumps(
            [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.output_len}
             for r in requests]))
        subprocess.run([str(python), str(RUNNER), "--model", str(hf_dir),
                        "--requests", str(tmp / "requests.json"),
                        "--output", str(tmp / "results.json"), "--dtype", dtype,
                        "--max-model-len", str(max_model_len),
                        "--kv-cache-gib", str(kv_cache_gib)], check=True)
        results = json.loads((tmp / "results.json").read_text())
    tokens = sum(results["output_tokens"])
    return {**results, "output_tokens_total": tokens,
            "output_tokens_per_s": tokens / results["elapsed_s"]}
