# Two entry points matter: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint protos venv clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/specsplit demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

protos: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. protos/specsplit/v1/*.proto

test: $(STAMP)
	$(BIN)/ruff check .
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -x $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
