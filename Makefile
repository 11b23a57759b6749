# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make train    the default paired run on the bundled corpus (extra flags: make train ARGS="--seeds=0,1,2")
#   make test     the test suite (what CI runs; make test ARGS='-m "not slow"' is the fast lane)
#   make lint     the layout rule: ruff check and ruff format --check at 120 characters (CI runs it)
# Both create the virtual environment .venv, or reuse it, and install requirements.txt into it whenever
# that file is newer than the last install; make test also installs requirements-extras.txt (the Hugging
# Face export, lm-eval and ruff, about 475 MB), which training never needs.
PYTHON := .venv/bin/python
# One thread per process: on a CPU torch's default of one per core ran 13x slower under load (README).
export OMP_NUM_THREADS ?= 1

train: .venv/installed
	$(PYTHON) train.py $(ARGS)

test: .venv/installed .venv/extras-installed
	$(PYTHON) -m pytest tests $(ARGS)

lint: .venv/extras-installed
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

.venv/installed: requirements.txt
	test -x $(PYTHON) || python3 -m venv .venv
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

.venv/extras-installed: .venv/installed requirements-extras.txt
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-extras.txt
	touch $@

.PHONY: train test lint
