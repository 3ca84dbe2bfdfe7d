# The two commands a new user runs:
#   make run    installs, brings up prefill + decode (EAGLE 1 step) + router on :30000 serving the
#               shipped small model (deploy/launch_local.py; more flags: make run ARGS="...",
#               e.g. ARGS=--tiny for the random tiny checkpoint)
#   make test   installs everything and runs lint + the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install run test
$(PY):
	python3 -m venv $(VENV)

# libibverbs1: Mooncake's CPU wheel loads it. docker-compose: the tests validate deploy/ with it.
install: $(PY)
	@dpkg -s libibverbs1 docker-compose >/dev/null 2>&1 || { apt-get update -qq && \
		apt-get install -y -qq libibverbs1 docker-compose; }
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,cpu,training]"

run: install
	$(PY) deploy/launch_local.py $(ARGS)

# The Triton kernels' CPU cases run only under Triton's interpreter (tiny shapes; their GPU cases
# are the device's): a second pass over the files that hold them, and the whole model's fast path
# (tests/test_interpreted_fast_path.py); two processes, the interpreter being single-threaded.
# fla-core (KDA's kernels, pure Python) joins that pass from beside the venv, not inside it: where
# fla is importable, transformers' glm5_next (the main pass's oracle) takes fla's kernels over torch.
KERNEL_TESTS = $(wildcard tests/test_triton_*.py tests/test_moe_*grouped.py) \
	tests/test_interpreted_fast_path.py
FLA_INTERP := $(VENV)/fla-interp

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	test -d $(FLA_INTERP)/fla || $(PY) -m pip install -q --no-deps --target $(FLA_INTERP) \
		fla-core==0.6.0 einops==0.8.2
	TRITON_INTERPRET=1 PYTHONPATH=$(FLA_INTERP) $(PY) -m pytest -q -n 2 -m "not gpu" $(KERNEL_TESTS)
