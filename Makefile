# Two commands for a new user: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autopar-installed

.PHONY: demo test bench stress venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m autopar demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks

# 10,000 mutated strategy files: each loads with its meaning unchanged or fails typed
stress: $(STAMP)
	AUTOPAR_FUZZ_EXAMPLES=10000 $(PY) -m pytest -q tests/test_checkpoint.py -k fuzz

clean:
	rm -rf $(VENV) build *.egg-info
