#!/usr/bin/env bash
# W4-shaped mixed load (long prompts among short ones) through router + 1 prefill + 1 decode
# instance (1 thread each, pinned to core 0 and core 1 with taskset: each its own core, as on
# two machines) against one colocated instance on 2 threads; summaries as JSON.
# Usage: benchmarks/disagg_w4.sh OUT_DIR [NUM_PROMPTS] [CONCURRENCY] [LONG_INPUT_LEN]
set -euo pipefail
out=${1:?output directory}
n=${2:-24}
c=${3:-8}
long=${4:-1000}
mkdir -p "$out"
PY=${PYTHON:-python}
ps() { $PY -m pagedserve.entrypoints.cli "$@"; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
common=(--kv-cache-memory 512MiB --max-model-len 2048 --uvicorn-log-level warning --disable-uvicorn-access-log)
taskset -c 0 $PY -m pagedserve.entrypoints.cli serve --port 8311 --num-threads 1 "${common[@]}" \
   --kv-transfer-config '{"kv_connector": "PagedServeConnector", "kv_role": "kv_producer", "lease_seconds": 60}' \
   > "$out/prefill.log" 2>&1 & pids+=($!)
taskset -c 1 $PY -m pagedserve.entrypoints.cli serve --port 8312 --num-threads 1 "${common[@]}" \
   --kv-transfer-config '{"kv_connector": "PagedServeConnector", "kv_role": "kv_consumer"}' \
   > "$out/decode.log" 2>&1 & pids+=($!)
ps serve --port 8313 --num-threads 2 "${common[@]}" > "$out/colocated.log" 2>&1 & pids+=($!)
ps router --port 8310 --uvicorn-log-level warning --prefill http://127.0.0.1:8311 --decode http://127.0.0.1:8312 \
   > "$out/router.log" 2>&1 & pids+=($!)
for port in 8311 8312 8313 8310; do
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
done
bench=(bench serve --ignore-eos --no-progress --dataset-name mixed --short-input-len 64 --long-input-len "$long"
       --long-every 8 --output-len 64 --range-ratio 0 --max-concurrency "$c" --num-prompts "$n")
ps "${bench[@]}" --base-url http://127.0.0.1:8313 --out "$out/w4-colocated.json" | tee "$out/w4-colocated.txt"
ps "${bench[@]}" --base-url http://127.0.0.1:8310 --out "$out/w4-pd.json" | tee "$out/w4-pd.txt"
