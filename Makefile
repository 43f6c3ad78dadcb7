# Every target sets itself up on a fresh machine: a venv with the pinned CPU torch,
# megatron-core and the test extras. Override PY / VENV / MCORE to taste.
PY     ?= python3
VENV   ?= .venv
MCORE  ?= megatron-core==0.16.1
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test test-gpu demo clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" "$(MCORE)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

# GPU tests: ranks sharing one GPU through torch symmetric memory (skipped without a GPU).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/gpu

demo: $(STAMP)
	$(BIN)/python examples/ab_overlap.py

clean:
	rm -rf $(VENV) runs wandb
