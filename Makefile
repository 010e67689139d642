# Two commands do all set-up on a fresh CPU-only Linux machine with Python 3.11:
#   make run    the main job on the embedded default (params/smollm2-135m.yaml) -> outputs/smollm2-135m/report/index.html
#   make test   the test suite (what CI runs)
# Each creates or refreshes .venv first (idempotent: nothing is installed when nothing changed).
VENV ?= .venv
PY := $(VENV)/bin/python
PARAMS ?= params/smollm2-135m.yaml
PYTEST_ARGS ?=

.PHONY: venv run test test-fast lab status report clean-venv

venv:
	@bash scripts/setup_venv.sh

run: venv
	$(PY) -m eagle3 run $(PARAMS)

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# --allow-root: containers and cloud machines often run as root; --ip=127.0.0.1: reachable from this
# machine only (from elsewhere: ssh -L 8888:127.0.0.1:8888 HOST). Jupyter prints the URL with its token.
lab: venv
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --allow-root --ip=127.0.0.1

status:
	$(PY) -m eagle3 status outputs/$(notdir $(basename $(PARAMS)))

report:
	$(PY) -m eagle3 report outputs/$(notdir $(basename $(PARAMS)))

clean-venv:
	rm -rf $(VENV)
