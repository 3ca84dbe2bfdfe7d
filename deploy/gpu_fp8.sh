#!/usr/bin/env bash
# One device call (under 9 minutes on one H200): issue 23's FP8 checks and benchmarks.
#
#   bash deploy/gpu_fp8.sh      # in the repository root, on the GPU machine; carry .whl/
#
# Needs .whl/fla_core-*.whl (deploy/gpu_wheels.sh). Each step has its own time limit and writes
# under $OUT as it goes, so a step that fails or runs out leaves the others' results:
#   kernels.log            pytest -m gpu tests/test_triton_kernels_fp8.py (FP8 linear at every
#                          real projection shape, FP8 fused MoE real/bench, CUDA graphs)
#   fp8_kernels.json/.log  bench_kernels_moe_kda --only fp8: FP8 GEMM TFLOP/s at 8,192 tokens
#                          beside bf16, FP8 MoE at 1/32/128/8,192 tokens (GB/s vs 4.23 TB/s)
#   fast_path.jsonl/.log   bench_fast_path --fp8: bench preset, prefill 512/2,048/8,192 and
#                          decode with graphs at batch 1/32/128, FP8 beside bf16; logits drift
#   model.log              pytest -m gpu -s tests/test_gpu.py -k fp8: FP8 decode graphs equal
#                          eager; the small model in FP8 within 2% perplexity of bf16 (printed)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...: run with a limit, log, keep going
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
}
step kernels 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels_fp8.py
step fp8_kernels 120 python3 -m serving.tools.bench_kernels_moe_kda --only fp8 \
    --out "$OUT/fp8_kernels.json"
step fast_path 165 python3 -m serving.tools.bench_fast_path --fp8 --stages logits,prefill,decode \
    --budget-s 130 --out "$OUT/fast_path.jsonl"
step model 75 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu.py -k fp8
tail -n 3 "$OUT"/*.log
