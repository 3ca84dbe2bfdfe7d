#!/usr/bin/env bash
# One device call: the GPU test suite (`pytest -m gpu`), timed, on the device image.
#
#   bash bench/gpu_tests.sh [PYTEST ARGS...]      # repository root, on the GPU machine; carry .whl/
#
# The image lacks our serving dependencies (bench/gpu_wheels.sh fills .whl/) and the test-only
# clients (openai, sglang-router), so this collects only the files that hold GPU tests: a plain
# `pytest -m gpu` would fail collecting the OpenAI tests' modules. Writes $OUT/gpu_tests.log
# (one line per test as it finishes, a failure's report as soon as it fails, then the 20
# slowest tests) and $OUT/junit.xml. A run cut off by the call's time limit writes no junit.xml
# and no summary; the log's lines, written unbuffered, still say which tests passed, why the
# failed ones failed and which one was running. Where pytest-timeout is installed (the device
# image has it) a test stuck in Python for PDSERVE_GPU_TEST_TIMEOUT seconds (default 300) fails
# and the run goes on; one stuck in compiled code is not interrupted.
#
# The suite's time is mostly Triton and fla compiling and autotuning on a cold cache, one kernel
# at a time per process, on a 16-core host: so the tests run in PDSERVE_GPU_TEST_WORKERS
# (default 8 on a card of 120 GB or more, the H200's 141; 4 on an 80 GB H100, where 8 ran out of
# memory beside a real-shape MoE test) pytest-xdist processes sharing the GPU (the image has
# xdist), each with 2 CPU threads, the heaviest (tests/test_gpu.py, collected first) handed out
# first. Tests marked xdist_group("real_moe") (the real-shape MoE cases, 20-45 GB each) share one
# process, so at most one of them holds its memory at a time: side by side, three of them ran the
# GPU out of memory.
# The two launch checks (xdist_group("launch_checks")) share one too: the second compiles little.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
TIMEOUT=()
python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout "${PDSERVE_GPU_TEST_TIMEOUT:-300}")
mapfile -t FILES < <(grep -l "mark\.gpu" tests/test_*.py)
echo "GPU test files: ${FILES[*]}" | tee "$OUT/gpu_tests.log"
t0=$SECONDS
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
WORKERS=${PDSERVE_GPU_TEST_WORKERS:-$([ "${MIB:-0}" -ge 120000 ] && echo 8 || echo 4)}
echo "workers: $WORKERS (${MIB:-?} MiB)" | tee -a "$OUT/gpu_tests.log"
XDIST=()
[ "$WORKERS" -gt 1 ] && XDIST=(-n "$WORKERS" --dist loadgroup)
OMP_NUM_THREADS=2 python3 -m pytest -m gpu -v -p no:cacheprovider -p bench.instafail "${XDIST[@]}" \
    "${TIMEOUT[@]}" -rfE --durations=20 --junitxml="$OUT/junit.xml" "${FILES[@]}" "$@" 2>&1 |
    tee -a "$OUT/gpu_tests.log"
echo "pytest -m gpu: $((SECONDS - t0)) s" | tee -a "$OUT/gpu_tests.log"
