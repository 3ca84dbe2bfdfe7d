# The two commands a new user runs:
#   make run    installs, writes the tiny checkpoint (first use) and serves it on :30000
#   make test   installs everything and runs lint + the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
TINY := models/tiny

.PHONY: install run test
$(PY):
	python3 -m venv $(VENV)

install: $(PY)
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; }
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,cpu]"

$(TINY)/config.json: | install
	$(PY) -m serving.tiny_model $(TINY)

run: install $(TINY)/config.json
	$(PY) -m serving.launch_server --model-path $(TINY) --served-model-name tiny --port 30000

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
