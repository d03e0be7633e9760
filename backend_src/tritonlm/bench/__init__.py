"""tritonlm-bench: offline and served throughput and latency, side by side with HF and vLLM."""
