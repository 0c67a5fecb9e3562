# Two entry points on a fresh machine with Python >= 3.11 and make:
#   make demo   - install, build the demo model if missing, run the main job on it
#   make test   - install with the dev extra, lint, run the whole test suite
#   make serve  - the demo model as a server: gRPC on 127.0.0.1:50051, the OpenAI API on :8000
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build; on a CUDA machine set TORCH=torch (or keep the torch already in the venv).
TORCH ?= torch==2.13.0
DEMO_PRESET ?= bench
DEMO_MODEL ?= models/demo-$(DEMO_PRESET)
DEMO_PROMPTS ?= examples/demo_prompts.jsonl
DEMO_OUT ?= models/demo-out.parquet
DEMO_TOKENS ?= 32
DEMO_QUANTIZE ?= auto
# int4's group size: 32 divides the tiny preset's widths too (the bench preset also takes 128)
DEMO_GROUP_SIZE ?= 32

.PHONY: install dev test lint demo demo-model serve clean proto

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m moe_lightning.native  # the host kernels, built for this CPU (docs/kv-cache.md)
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q -e '.[eval]' || echo "lm-eval / litellm did not install: their tests skip"
	$(BIN)/python -m moe_lightning.native
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
dev: $(VENV)/.installed-dev

lint: dev
	$(BIN)/ruff check .

test: dev lint
	$(BIN)/python -m pytest -q

$(DEMO_MODEL)/config.json: | $(VENV)/.installed
	$(BIN)/moe-lightning make-demo-model --preset $(DEMO_PRESET) --out $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json

demo: install demo-model
	$(BIN)/moe-lightning run --model $(DEMO_MODEL) --input $(DEMO_PROMPTS) --output $(DEMO_OUT) --overwrite \
		--max-new-tokens $(DEMO_TOKENS) --ignore-eos --cache-dir models/arena-cache --show 3 \
		--quantize $(DEMO_QUANTIZE) --quantize-group-size $(DEMO_GROUP_SIZE)

serve: install demo-model
	$(BIN)/moe-lightning up --model $(DEMO_MODEL) --cache-dir models/arena-cache \
		--quantize $(DEMO_QUANTIZE) --quantize-group-size $(DEMO_GROUP_SIZE)

clean:
	rm -rf $(VENV) models .pytest_cache .ruff_cache *.egg-info

# Generated code is committed; tests/test_protos.py regenerates it and fails on any difference.
PROTOS := $(shell find protos -name '*.proto')
proto: dev
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
