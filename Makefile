VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tritonlm-setup
REPO ?= model_repository
MODEL ?= llm
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
FRONTEND_PORT ?= 8080

.PHONY: setup setup-vllm serve test bench bench-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml tools/setup.sh
	tools/setup.sh
	touch $(STAMP)

$(REPO)/$(MODEL)/config.pbtxt: | $(STAMP)
	$(VENV)/bin/tritonlm-convert default --output $(REPO) --name $(MODEL)

serve: setup $(REPO)/$(MODEL)/config.pbtxt
	$(VENV)/bin/tritonlm-serve --model-repository $(REPO) --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --frontend-port $(FRONTEND_PORT)

test: setup
	$(PY) -m pytest -q -n $(shell nproc) --dist worksteal --durations=30 tests

setup-vllm:
	tools/setup_vllm.sh

bench: setup
	$(VENV)/bin/tritonlm-bench --mode offline serve --concurrency 32 --stream-interval 1,4 \
		--compare hf --compare-dtypes bfloat16 float32 --roofline --rounds 3 \
		--json bench_results/fixed.json --plot bench_results/fixed.png

bench-vllm: setup setup-vllm
	$(VENV)/bin/tritonlm-bench --compare hf vllm --compare-dtypes bfloat16 float32 --rounds 3 \
		--json bench_results/vllm.json

clean:
	rm -rf $(VENV) .venv-vllm $(REPO)/$(MODEL)
