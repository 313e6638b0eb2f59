# Two commands do everything on a fresh machine (Python 3.11, no GPU):
#   make demo   set up, then export a built-in MoE, compile it, load it and generate (prints timings)
#   make test   set up, then run the test suite (what CI runs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test clean

$(BIN)/moec: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/moec

setup: $(BIN)/moec

demo: setup
	$(BIN)/moec demo --model tiny --batch 4 --new-tokens 32

test: setup
	$(BIN)/python -m pytest -q -m "not gpu" -n auto --dist loadfile --durations=15 tests

clean:
	rm -rf $(VENV) artifacts .pytest_cache
