# Two entry points: `make demo` (set up and run the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast clean

$(BIN)/chimera: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/chimera

setup: $(BIN)/chimera

demo: setup
	$(BIN)/chimera train
	$(BIN)/chimera show --stages 4 --micro-batches 4 --png out/chimera-D4-N4.png

test: setup
	$(BIN)/python -m pytest -q -x --durations=10

test-fast: setup
	$(BIN)/python -m pytest -q -x -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
