"""README's multi-host recipe on two simulated hosts (distinct loopback addresses): tritonserver
runs rank 0 with MASTER_ADDR / MASTER_PORT and TRITONLM_EXTERNAL_WORKERS=1, rank 1 is a
`tritonlm-worker` started by hand; greedy tokens equal transformers' in one process."""
import subprocess
import sys
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

from family_check import random_prompts, reference_greedy, save_tiny
from test_server import grpc_stream
from triton_server import start_server
from tritonlm.ports import free_ports

WORKER = Path(sys.executable).parent / "tritonlm-worker"
RANK0_HOST = "127.0.0.2"  # rank 0's "host"; the worker is on 127.0.0.1
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def test_rank_on_another_host_serves_what_one_process_does(tmp_path, smollm2_tokenizer, monkeypatch):
    from tritonlm_convert.convert import convert
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.1, vocab_size=len(smollm2_tokenizer),
                         max_position_embeddings=512)
    hf = save_tiny(tmp_path / "hf", LlamaForCausalLM, config, smollm2_tokenizer)
    model_dir = convert(str(tmp_path / "hf"), tmp_path / "repo", dtype="float32", tp=2)
    port = free_ports(1)[0]
    monkeypatch.setenv("MASTER_ADDR", RANK0_HOST)
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TRITONLM_EXTERNAL_WORKERS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    worker = subprocess.Popen([str(WORKER), str(model_dir / "1"), "--rank", "1", "--world-size", "2",
                               "--init-method", f"tcp://{RANK0_HOST}:{port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with start_server(tmp_path / "repo", timeout=180) as server:
            for seed in (1, 2):
                prompt = random_prompts(1, config.vocab_size, seed=seed)[0]
                results, error = grpc_stream(server.grpc_url, prompt, GREEDY)
                assert error is None, error
                tokens = [int(t) for r in results for t in r.as_numpy("token_ids")]
                assert tokens == reference_greedy(hf, prompt, GREEDY["max_tokens"])
            assert worker.poll() is None  # rank 1 serves every step
        # the server's rank 0 gone, the worker stops by itself
        assert worker.wait(60) == 0, worker.stdout.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
