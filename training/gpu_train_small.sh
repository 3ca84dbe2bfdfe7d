#!/usr/bin/env bash
# One device call (under 10 minutes on one H200): train the small model and export it.
#
#   bash training/gpu_train_small.sh [MINUTES]     # in the repository root, on the GPU machine
#
# Needs, beside the tracked tree (31 MiB, the shipped checkpoint included), two carried paths:
#   data/gpu-carry      tokenizer files, config.json and one part of the token shards, made here
#                       by `python -m training.corpus`, `python -m training.train_small
#                       --run data/small-run --prepare-only` and `python -m training.
#                       token_shards stage --part 1` (26 MiB at most, docs/SMALL_MODEL.md)
#   .whl/fla_core-0.6.0-py3-none-any.whl   (bench/gpu_wheels.sh; 1 MiB; or a copy of it in
#                       data/gpu-carry, when carrying one file of .whl/ is not possible)
# The run folder is data/gpu-run, which is not carried, so a later call on the still-warm
# machine finds state.pt there and resumes (carrying another part: --part 2). Writes under $OUT:
# train.log, log.jsonl, export_check.json and the checkpoint as small_model.tar.part-* (each
# under 16 MiB: `cat small_model.tar.part-* | tar x` gives small_model/).
#
# MINUTES (default 7.5) is the training's budget from the trainer's start, Triton's compiling
# included; exporting and packing take about 1.5 minutes more. STEPS (default auto: as many as
# fit this call) fixes the plan's length, the cosine schedule's end: for two calls on a warm
# machine give both STEPS=2600 (a resume keeps the first call's plan and ignores it).
# EXTEND=N, on a warm machine whose run has finished its plan: N more steps on a second cosine
# segment (train_small --extend).
set -euo pipefail
MINUTES=${1:-7.5}
STEPS=${STEPS:-auto}
OUT=${OUT:-/tmp/out}
CARRY=${CARRY:-data/gpu-carry}  # another staged part: CARRY=data/gpu-carry2
RUN=data/gpu-run
mkdir -p "$OUT" "$RUN"
WHEEL=$(compgen -G ".whl/fla_core-*.whl" || compgen -G "$CARRY/fla_core-*.whl")  # either place
WHEEL=${WHEEL%%$'\n'*}
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEEL"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import fla, torch, transformers; print('fla', fla.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
RESUME=()
if [ -f "$RUN/state.pt" ]; then
    RESUME=(--resume ${EXTEND:+--extend "$EXTEND"})
else
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja \
             config.json; do cp "$CARRY/$f" "$RUN/$f"; done
fi
python3 -m training.train_small --run "$RUN" --tokens "$CARRY/tokens" --device cuda \
    --minutes "$MINUTES" --steps "$STEPS" "${RESUME[@]}" 2>&1 | tee "$OUT/train.log"
cp "$RUN/log.jsonl" "$OUT/log.jsonl"
rm -rf data/small_model
# Without fla on the path: the export check runs transformers on the CPU, where fla's Triton
# kernels would be handed CPU tensors.
PYTHONPATH=$PWD python3 -m training.train_small --run "$RUN" --tokens "$CARRY/tokens" \
    --export data/small_model 2>&1 \
    | grep -v "UNEXPECTED\|^model\.\|^-\|^Key\|^$" | tee -a "$OUT/train.log"
cp data/small_model.export_check.json "$OUT/export_check.json"
(cd data && tar cf - small_model) | split -b 15M - "$OUT/small_model.tar.part-"
ls -la "$OUT"
