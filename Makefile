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

# The whole GPU suite on a GPU machine (ranks sharing one GPU through torch symmetric
# memory), spread over pytest-xdist workers: tests/gpu/suite.sh. PYTHON picks the
# interpreter (this venv's: PYTHON=$(BIN)/python make test-gpu).
test-gpu:
	bash tests/gpu/suite.sh

demo: $(STAMP)
	$(BIN)/python examples/ab_overlap.py

clean:
	rm -rf $(VENV) runs wandb
