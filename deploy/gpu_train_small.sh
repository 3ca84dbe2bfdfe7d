#!/usr/bin/env bash
# One device call (under 10 minutes on one H200): train the small model and export it.
#
#   bash deploy/gpu_train_small.sh [MINUTES]     # in the repository root, on the GPU machine
#
# Needs, beside the tracked tree: data/corpus (python -m serving.tools.corpus), data/small-run
# with the tokenizer files and config.json (train_small's prepare step; tokens.pt is rebuilt
# here) and .whl/fla_core-*.whl (deploy/gpu_wheels.sh). Writes under $OUT: train.log,
# log.jsonl, export_check.json and the checkpoint as small_model.tar.part-* (each under 16 MiB:
# `cat small_model.tar.part-* | tar x` gives small_model/). state.pt stays in data/small-run for
# a --resume while the machine is warm.
set -euo pipefail
MINUTES=${1:-7}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import fla, torch, transformers; print('fla', fla.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
RESUME=()
[ -f data/small-run/state.pt ] && RESUME=(--resume)
python3 -m serving.tools.train_small --run data/small-run --corpus data/corpus --device cuda \
    --minutes "$MINUTES" "${RESUME[@]}" 2>&1 | tee "$OUT/train.log"
cp data/small-run/log.jsonl "$OUT/log.jsonl"
rm -rf data/small_model
python3 -m serving.tools.train_small --run data/small-run --export data/small_model 2>&1 \
    | grep -v "UNEXPECTED\|^model\.\|^-\|^Key\|^$" | tee -a "$OUT/train.log"
cp data/small_model.export_check.json "$OUT/export_check.json"
(cd data && tar cf - small_model) | split -b 15M - "$OUT/small_model.tar.part-"
ls -la "$OUT"
