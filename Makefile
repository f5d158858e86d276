# The two commands: `make demo` (train the demo GPT with ZeRO-2 on 2 CPU processes) and `make test`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lzero-installed

.PHONY: demo test test-all bench clean bench-cluster

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: installing lightning first would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	# litgpt runs unchanged in tests/lightning/test_fabric.py; its pins (huggingface-hub<1.4) clash with transformers 5, and the
	# parts the tests run need none of them
	$(BIN)/python -m pip install -q --no-deps "litgpt==0.5.13"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/lzero fit --config configs/demo_zero2.yaml --trainer.enable_progress_bar false
	@echo
	@echo "TensorBoard logs and checkpoints: $$(ls -td runs/demo/demo/version_* | head -1)"
	@echo "  view with: $(BIN)/tensorboard --logdir runs/demo"

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20

test-all: $(STAMP)  # the default run and the slow fault cases it leaves out (pytest -m slow)
	$(BIN)/python -m pytest -q --durations=20 -m ""

# DeepSpeed rows: DEEPSPEED_PYTHON=/path/to/a/deepspeed-venv/bin/python (see benchmarks/peers/peer_deepspeed_step.py)
DEEPSPEED_PYTHON ?=
bench: $(STAMP)
	$(BIN)/python -m benchmarks.step_time.bench_speed --repeat 2 --readme README.md $(if $(DEEPSPEED_PYTHON),--deepspeed-python $(DEEPSPEED_PYTHON))

# the simulated two-node cluster (root: network namespaces, tc); not part of CI
bench-cluster: $(STAMP)
	$(BIN)/python -m benchmarks.cluster.bench_cluster --rates 1gbit 10gbit --rounds 3 --probe
	$(BIN)/python -m benchmarks.cluster.two_level --validate latest --table

clean:
	rm -rf runs lightning_logs .pytest_cache
