#!/usr/bin/env bash
# relayout's vLLM checks on your GPU node (vLLM and relayout installed in one environment):
#   bash deploy/gpu/vllm_gpu_check.sh [--model HF_DIR] [--tp N] [--json results.json]
# Each check asserts (exit 1 if any failed): an export -> load -> export round trip bit-exact per rank,
# a forced preemption, FlashAttention and FlashInfer, CUDA graphs on and off, vLLM's step during an
# export (>= 0.95 of without). Without a GPU it runs what vLLM's CPU build can and skips the rest (exit 0).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import vllm, relayout' 2>/dev/null; then
  echo "vllm_gpu_check: $PY cannot import vllm and relayout: install both (pip install -e '.[vllm]' with your vLLM)" >&2
  exit 2
fi
exec "$PY" deploy/gpu/vllm_gpu_check.py "$@"
