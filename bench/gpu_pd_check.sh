#!/usr/bin/env bash
# One device call (under 10 minutes on a fresh H200; each step time-limited): issue 25's check of
# the PD stack at the seed's settings. The sync check first (does a step launch wait for the
# device?), then bench/pd_bench.py with and without EAGLE at c=32 (three runs) and c=1,
# 1,024-token prompts, OUTPUT_LEN output tokens (default 256), each run also straight to the
# workers (--direct: what the router adds), both workers profiled for 20 steps of the second c=32
# run (the first is the first loaded run after start-up, compared unprofiled with the third;
# PROFILE=0 profiles nothing, KEEP_TRACES=1 also keeps the traces), then the bench preset's
# decode steps at batch 1 and 32 for the ratios (context prefilled, as the server's is) and
# EAGLE's step (its graphs need the context mapped).
#
#   bash bench/gpu_pd_check.sh                      # repository root, GPU machine; carry .whl/
#   OUTPUT_LEN=64 PROFILE=0 bash bench/gpu_pd_check.sh
#
# Writes under $OUT (4 files): sync_check.json (per path: syncs, their sites, blocked, and where
# a blocked launch waited),
# pd$OUTPUT_LEN.tgz (results.json with TTFT's parts per run, each variant's profile_summary.json
# and the last 3 MB of each process's log), steps.jsonl and eagle_steps.jsonl
# (bench.fast_path's); and prints each step's exit status and time.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
t0=$SECONDS
step() {  # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@"
  echo "$name: exit $? at $((SECONDS - t0)) s"
}
# a 2 s sleep: the CLI traces its watched launches, which slows them (sync_check's doc); cold,
# the build and the warm-up take about 125 s
step sync_check 170 python3 -m bench.sync_check --sleep-ms 2000 --out "$OUT/sync_check.json"
WA="--max-running-requests 32 --cuda-graph-max-bs-decode 32 --cuda-graph-backend-decode full \
 --chunked-prefill-size 8192 --max-prefill-tokens 8192 --kv-cache-dtype bf16 \
 --skip-server-warmup --watchdog-timeout 600"
LEN=${OUTPUT_LEN:-256}
RUN=pd$LEN
PROFILE_ARGS=()
[ "${PROFILE:-1}" = 1 ] && PROFILE_ARGS=(--profile-steps 20 --profile-run 2 --profile-delay-s 2)
[ "${KEEP_TRACES:-0}" = 1 ] && PROFILE_ARGS+=(--keep-traces)
step pd_bench 360 python3 bench/pd_bench.py --wheels .whl --build-checkpoint /tmp/bench \
    --preset bench --worker-args="$WA" --variant side= \
    --variant eagle1="--speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-num-draft-tokens 2" \
    --bench 32:64 --bench 32:64 --bench 32:64 --bench 1:8 --input-len 1024 --output-len "$LEN" \
    --direct "${PROFILE_ARGS[@]}" --out "/tmp/$RUN" > "/tmp/$RUN.log" 2>&1
tail -25 "/tmp/$RUN.log"
cp "/tmp/$RUN.log" "/tmp/$RUN/" 2>/dev/null
for f in /tmp/"$RUN"/*/*.log; do  # keep the batch lines' tail, not whole logs
  [ -f "$f" ] && tail -c 3000000 "$f" > "$f.tail" && mv "$f.tail" "$f"
done
tar czf "$OUT/$RUN.tgz" -C /tmp "$RUN"
step steps 60 python3 -m bench.fast_path --out "$OUT/steps.jsonl" --stages decode \
    --batch-sizes 1,32 --contexts 1024 --no-torch-path
step eagle_steps 60 python3 -m bench.fast_path --out "$OUT/eagle_steps.jsonl" \
    --stages eagle --batch-sizes 1,32 --contexts 1024 --context-fill mapped --spec-steps 1 \
    --no-torch-path
