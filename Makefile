# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make train    the default paired run on the bundled corpus (extra flags: make train ARGS="--seeds=0,1,2")
#   make test     the test suite (what CI runs)
# Both create the virtual environment .venv, or reuse it, and install requirements.txt and
# requirements-extras.txt (the Hugging Face export and lm-eval) into it whenever either is newer
# than the last install.
PYTHON := .venv/bin/python

train: .venv/installed
	$(PYTHON) train.py $(ARGS)

test: .venv/installed
	$(PYTHON) -m pytest tests $(ARGS)

.venv/installed: requirements.txt requirements-extras.txt
	test -x $(PYTHON) || python3 -m venv .venv
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-extras.txt
	touch $@

.PHONY: train test
