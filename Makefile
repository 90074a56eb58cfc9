# Everything installs into .venv from nothing: torch first (pinned, CPU build), then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: install demo lint test test-unit test-all clean

# What the demo needs and no more: torch, then the project with the embedded stack and the
# examples' packages, and npm's packages (the local console's JavaScript; asl-validator comes
# along, a few MB). make demo on a fresh machine does not wait for lint tools it never runs.
$(DEMO_STAMP): pyproject.toml package.json package-lock.json
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[local,examples]"
	npm ci --no-audit --no-fund --loglevel=error
	touch $(DEMO_STAMP)

# Everything the tests and `make lint` use: the dev extras and checkov.
$(STAMP): $(DEMO_STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[dev]"
	# checkov (template.yaml's security checks in `make lint`) in a venv of its own: its pins clash with ours
	python3 -m venv $(VENV)-checkov
	$(VENV)-checkov/bin/pip install -q checkov==3.3.30
	touch $(STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/stagecoach train examples/digits.py

lint: $(STAMP)
	VENV=$(VENV) .ci/lint

test: $(STAMP)
	$(PY) -m pytest -m "not slow" --durations=25

test-unit: $(STAMP)
	$(PY) -m pytest -m "not slow and not stack"

test-all: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) $(VENV)-checkov node_modules stagecoach-runs
