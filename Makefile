VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tritonlm-setup
REPO ?= model_repository
MODEL ?= llm
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml tools/setup.sh
	tools/setup.sh
	touch $(STAMP)

$(REPO)/$(MODEL)/config.pbtxt: | $(STAMP)
	$(VENV)/bin/tritonlm-convert default --output $(REPO) --name $(MODEL)

serve: setup $(REPO)/$(MODEL)/config.pbtxt
	$(VENV)/bin/tritonlm-serve --model-repository $(REPO) --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m tritonlm.bench

clean:
	rm -rf $(VENV) $(REPO)/$(MODEL)
