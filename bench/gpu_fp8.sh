#!/usr/bin/env bash
# One device call (about 8 minutes on a warm H200; each step time-limited, 570 s of limits in
# all): issue 23's FP8 checks and benchmarks.
#
#   bash bench/gpu_fp8.sh      # in the repository root, on the GPU machine; carry .whl/
#
# Needs .whl/fla_core-*.whl (bench/gpu_wheels.sh). Each step has its own time limit and writes
# under $OUT as it goes, so a step that fails or runs out leaves the others' results (8 files):
#   steps.txt              the GPU, torch/triton/CUDA versions, each step's exit status and time
#   kernels.log            pytest -m gpu tests/test_triton_kernels_fp8.py: the FP8 linear at every
#                          real projection shape on each GEMM (Triton, torch._scaled_mm), which
#                          one is chosen, the FP8 fused MoE real/bench, CUDA graphs; the load-time
#                          FP8-or-bf16 choice at every TP1 and TP8 projection shape ("fp8 choice"
#                          lines: FP8 and bf16 us at 32 and 8,192 tokens)
#   fp8_kernels.json/.log  bench.kernels_moe_kda --only fp8: FP8 linear TFLOP/s at 8,192 tokens
#                          beside bf16 with both GEMMs side by side (triton_ms, scaled_mm_ms),
#                          1/32/128 tokens as graph-replayed device time; FP8 MoE at 1/32/128/
#                          8,192 tokens (GB/s vs 4.23 TB/s)
#   fast_path.jsonl/.log   bench.fast_path --fp8 --no-torch-path: bench preset, bf16 beside FP8
#                          (the projections timed slower in FP8 kept bf16, as a server does: the
#                          "fp8_quantized" row) for the 8,192-token prefill and decode with graphs
#                          at batch 1/32/128; FP8 logits drift against bf16
#   model.log              pytest -m gpu tests/test_gpu.py -k fp8: FP8 decode graphs equal eager
#                          (tiny, float32); the small model in FP8 within 2% perplexity of bf16;
#                          a simulated rank on an FP8 config (timed choice, plan == built)
#   eval_small.log         eval_small --stages fp8: the trained small model, FP8 against itself
#                          in bf16: perplexity ratio and greedy agreement (JSON line)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader \
    | tee "$OUT/steps.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__)" 2>&1 | tee -a "$OUT/steps.txt"
step() {  # step NAME SECONDS CMD...: run with a limit, log, keep going
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t0)) s (limit $limit)" | tee -a "$OUT/steps.txt"
}
# instafail (bench/instafail.py): each failure's report as it happens, so a cut run still says why
PYTEST=(python3 -m pytest -m gpu -p no:cacheprovider -p bench.instafail -rA --durations=8)
step kernels 85 "${PYTEST[@]}" -q -s tests/test_triton_kernels_fp8.py
step fp8_kernels 90 python3 -m bench.kernels_moe_kda --only fp8 \
    --out "$OUT/fp8_kernels.json"
step eval_small 80 python3 -m training.eval_small --stages fp8 \
    --heldout tests/data/small_heldout.txt --window 512 --ppl-windows 32 --prompts 32 \
    --new-tokens 32
# 110 s was too short twice (model build, in-memory quantization, both variants' compiles)
step fast_path 180 python3 -m bench.fast_path --fp8 --no-torch-path \
    --stages logits,prefill,decode --prefill-tokens 8192 --budget-s 165 \
    --out "$OUT/fast_path.jsonl"
# -v names each test as it starts; a hang dumps every thread's stack before the limit
step model 135 "${PYTEST[@]}" -v -s -o faulthandler_timeout=125 tests/test_gpu.py -k fp8
tail -n 3 "$OUT"/*.log
