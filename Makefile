# The two commands a new user runs:
#   make run    installs, writes the tiny checkpoint (first use), brings up prefill + decode +
#               router on :30000 (deploy/launch_local.py; more flags: make run ARGS="...")
#   make test   installs everything and runs lint + the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
TINY := models/tiny

.PHONY: install run test
$(PY):
	python3 -m venv $(VENV)

# libibverbs1: Mooncake's CPU wheel loads it. docker-compose: the tests validate deploy/ with it.
install: $(PY)
	@dpkg -s libibverbs1 docker-compose >/dev/null 2>&1 || { apt-get update -qq && \
		apt-get install -y -qq libibverbs1 docker-compose; }
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,cpu]"

$(TINY)/config.json: | install
	$(PY) -m serving.tools.tiny_model $(TINY)

run: install $(TINY)/config.json
	$(PY) deploy/launch_local.py $(ARGS)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
