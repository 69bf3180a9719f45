# Two entry points: `make demo` (set up and run the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo demo-hf test test-slow clean

$(BIN)/chimera: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/chimera

setup: $(BIN)/chimera

demo: setup
	$(BIN)/chimera train
	$(BIN)/chimera show --stages 4 --micro-batches 4 --png out/chimera-D4-N4.png

# a Llama with a BPE tokenizer trained on local text, held-out loss, export, generate;
# its pictures go to out/hf-demo/, beside make demo's in out/ (not over them)
demo-hf: setup
	rm -rf out/hf-demo
	$(BIN)/chimera tokenize --vocab-size 1024 --out out/hf-demo/tok
	$(BIN)/chimera train --model hf-llama-tiny --data out/hf-demo/tok --steps 200 --eval-every 50 \
		--checkpoint-dir out/hf-demo/ckpt --png out/hf-demo/train-timeline.png \
		--trace out/hf-demo/train-trace.json
	$(BIN)/chimera export --checkpoint out/hf-demo/ckpt --out out/hf-demo/llama-hf
	$(BIN)/chimera generate --checkpoint out/hf-demo/ckpt --prompt "def " --temperature 0 --max-new-tokens 30

# every test that stays in this process (virtual ranks, the CLI called in process), plus one
# `python -m chimera schedules` smoke run; tests that start processes and the largest cases of
# the schedule sweeps (D >= 8 or 16) are marked slow.
# Two pytest-xdist workers, a test file to a worker (its module fixtures built once); each
# test keeps its own tmp_path and writes nothing outside it. CI runs both targets (.ci/run)
test: setup
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile -m "not slow" --durations=10

# the tests marked slow: every test that starts processes (spawned gloo ranks, `python -m
# chimera` and `python -c` subprocesses, fresh-interpreter import checks, signals), run
# serially (their time limits assume no second test beside them); first the slow ones that
# start no process (marked sweep: the sweeps' largest cases) on two xdist workers
test-slow: setup
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile -m "slow and sweep" --durations=10
	$(BIN)/python -m pytest -q -x -m "slow and not sweep" --durations=10

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
