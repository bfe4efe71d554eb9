#!/usr/bin/env bash
# relayout's GPU checks, in one device run (< 10 min; every step has its own timeout and the
# whole script a deadline). From the repo root; on a machine without a GPU every step it can runs and
# the CUDA ones are reported skipped (exit 0 unless a step that ran failed):
#   1. setup: the system python3 that holds CUDA torch; relayout from this checkout on
#      PYTHONPATH, its missing dependencies from carried wheels (.whl/, see fetch_wheels.sh)
#      or, where an index is reachable, `pip install -e .[test,cuda]` constrained to the
#      installed torch (never reinstalled);
#   2. env: GPU, torch, and migrate.placement.topology.discover() through NVML;
#   3. pytest -m cuda tests/test_cuda.py (stager bit-exactness, engine snapshot/restore on
#      CUDA, stager D2H GB/s vs a raw pinned copy_, decode steps while a snapshot drains);
#   4. relayout bench snapshot --json;  5. relayout bench migration --quick --json;
#   6. the CPU tests of the staging/topology/checkpoint paths, now on CUDA (engines default to it).
#   5b. relayout bench vllm --json, where the image has vLLM (stock vLLM replicas, issue 28);
# Writes at most 8 files under $OUT (the device tool's limit): summary.txt, summary.json,
# env.log, pytest_cuda.log, bench_snapshot.log, bench_migration.log, bench_vllm.log,
# pytest_more.log (cuda_results.jsonl is folded into summary.json).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=${DEADLINE_S:-480}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"; : >/tmp/relayout_rcs

say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }
# step NAME LIMIT_S CMD...: runs CMD with output in $OUT/NAME.log, capped by the deadline
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - START) ))
  if (( left < 20 )); then say "SKIP $name: deadline"; echo "$name skipped" >>/tmp/relayout_rcs; return; fi
  (( limit > left )) && limit=$left
  say "== $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  say "   $name rc=$rc$([ $rc = 124 ] && echo ' (timed out)')"
  echo "$name $rc" >>/tmp/relayout_rcs
}

# ---- 1. setup -----------------------------------------------------------------------------------
# relayout installed for real (its package-dir mapping makes `relayout.*` importable; a PYTHONPATH
# pointing at the checkout does not): into a venv over the image's python (its CUDA torch kept), offline
# from the carried wheels when there are some, else from an index, else the python already has it.
{
  echo "# setup"
  if "$PY" -c 'import relayout.migrate.placement.topology' >/dev/null 2>&1; then
    echo "relayout already importable by $PY ($("$PY" -c 'import relayout, os; print(os.path.dirname(relayout.__file__))'))"
  else
    rm -rf /tmp/relayout-gpu-venv
    "$PY" -m venv --system-site-packages /tmp/relayout-gpu-venv && PY=/tmp/relayout-gpu-venv/bin/python
    if ls .whl/*.whl >/dev/null 2>&1; then
      timeout 300 "$PY" -m pip install -q --no-index --find-links .whl --no-build-isolation -e . \
        && echo "installed relayout offline with carried wheels: $(ls .whl | tr '\n' ' ')"
    else
      echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" >/tmp/torch-pin.txt
      timeout 300 "$PY" -m pip install -q -e ".[test,cuda]" -c /tmp/torch-pin.txt && echo "pip install -e .[test,cuda] done"
    fi
  fi
  echo "PY=$PY"
} >"$OUT/env.log" 2>&1
PY=$(sed -n 's/^PY=//p' "$OUT/env.log" | tail -1)
PY=${PY:-python3}
relayout() { "$PY" -m relayout.agent.cli "$@"; }

# ---- 2. env -------------------------------------------------------------------------------------
{
  echo "# env"
  nvidia-smi -L 2>&1 || true
  nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1 || true
  timeout 60 "$PY" - <<'PY'
import importlib, logging, torch
logging.basicConfig(level=logging.INFO)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
for m in ("relayout", "fastapi", "pydantic", "pydantic_settings", "uvicorn", "zstandard", "boto3",
          "opentelemetry", "httptools", "pynvml"):
    try:
        importlib.import_module(m); print("import", m, "ok")
    except Exception as e:
        print("import", m, "MISSING", e)
from relayout.migrate.placement import topology as T
topo = T.discover()
print("discover():", topo.model_dump_json(indent=1) if topo else f"None ({T.last_discover_reason})")
PY
} >>"$OUT/env.log" 2>&1
say "env: $(grep -m1 '^torch' "$OUT/env.log")"
say "discover: $(grep -m1 '^discover' "$OUT/env.log" | cut -c1-120)"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
# gpu_step: a step whose figures mean something on a GPU only: reported skipped without one (exit 0),
# so this script runs anywhere (CI runs it on a CPU machine: it cannot rot)
gpu_step() {
  if (( NGPU < 1 )); then say "SKIP $1: no CUDA GPU here"; echo "$1 skipped" >>/tmp/relayout_rcs; return; fi
  step "$@"
}

# ---- 3. GPU tests -------------------------------------------------------------------------------
export RELAYOUT_GPU_RESULTS="$OUT/cuda_results.jsonl"
: >"$RELAYOUT_GPU_RESULTS"
gpu_step pytest_cuda 170 "$PY" -m pytest -q -m cuda -s -p no:cacheprovider tests/test_cuda.py

# ---- 4./5. benches ------------------------------------------------------------------------------
gpu_step bench_snapshot 110 "$PY" -m relayout.agent.cli bench snapshot --json
# the --quick target layout is attn_tp=2: two ranks; on one GPU both share it (NCCL may refuse)
(( NGPU < 2 )) && say "note: $NGPU GPU(s); bench migration's attn_tp=2 target puts 2 ranks on one GPU"
RELAYOUT_STEP_TIMEOUT_S=60 gpu_step bench_migration 130 "$PY" -m relayout.agent.cli bench migration --quick --json

# ---- 5b. stock vLLM (issue 28): live migration of in-flight requests, where this image has vLLM ---------
# (RELAYOUT_GPU_VLLM_MODEL: an HF MoE directory, default the bench's tiny Qwen3-MoE; TP2 needs 2 GPUs)
if "$PY" -c 'import vllm' >/dev/null 2>&1; then
  VLLM_TARGET=$( (( NGPU >= 2 )) && echo "attn_tp=2,moe_tp=2" || echo "attn_tp=1")
  gpu_step bench_vllm 150 "$PY" -m relayout.agent.cli bench vllm --json --contexts 256,1024 --target-layout "$VLLM_TARGET" \
    ${RELAYOUT_GPU_VLLM_MODEL:+--model "$RELAYOUT_GPU_VLLM_MODEL"}
else
  say "SKIP bench_vllm: vllm is not importable in this image"; echo "bench_vllm skipped" >>/tmp/relayout_rcs
fi

# ---- 6. the CPU suite's staging/checkpoint tests, on CUDA ---------------------------------------
step pytest_more 90 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_staging.py tests/test_topology_discover.py \
  tests/test_checkpoint.py

# ---- summary ------------------------------------------------------------------------------------
"$PY" - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
res = {"steps": {}}
for line in pathlib.Path("/tmp/relayout_rcs").read_text().splitlines():
    name, rc = line.split()
    res["steps"][name] = rc
results = out / "cuda_results.jsonl"
for line in (results.read_text().splitlines() if results.exists() else []):
    d = json.loads(line); res[d.pop("test")] = d
for name in ("bench_snapshot", "bench_migration", "bench_vllm"):
    p = out / f"{name}.log"
    last = [l for l in p.read_text(errors="replace").splitlines() if l.startswith("{")] if p.exists() else []
    try:
        res[name] = json.loads(last[-1]) if last else None
    except json.JSONDecodeError:
        res[name] = None
(out / "summary.json").write_text(json.dumps(res, indent=1))
d = res.get("d2h_gbps", {})
dd = res.get("decode_during_drain", {})
s = res.get("bench_snapshot") or {}
print("steps:", res["steps"])
print(f"D2H GB/s: stager {d.get('stager_d2h_gbps')} / raw pinned {d.get('raw_pinned_d2h_gbps')} "
      f"(x{d.get('stager_vs_raw')}); old path {d.get('old_path_d2h_gbps')}; "
      f"H2D stager {d.get('stager_h2d_gbps')} / raw {d.get('raw_pinned_h2d_gbps')}")
print(f"decode while draining: {dd.get('steps_while_draining')} steps, {dd.get('step_ms_while_draining')} ms "
      f"vs {dd.get('base_step_ms')} ms (x{dd.get('step_ratio')}); drain {dd.get('drain_ms')} ms")
print(f"bench snapshot: memcpy {s.get('memcpy_gbps')} snapshot {s.get('snapshot_gbps')} restore {s.get('restore_gbps')} GB/s")
m = res.get("bench_migration") or {}
print("bench migration:", json.dumps(m.get("contexts")) if m else None)
v = res.get("bench_vllm") or {}
print("bench vllm:", json.dumps(v.get("contexts")) if v else None)
results.unlink(missing_ok=True)  # in summary.json now: the device tool brings back 8 files at most
failed = {k: v for k, v in res["steps"].items() if v not in ("0", "skipped")}
print("FAILED steps:" if failed else "every step that ran passed", failed or "")
sys.exit(1 if failed else 0)
PY
RC=${PIPESTATUS[0]}
rm -f /tmp/relayout_rcs
say "done (exit $RC)"
exit "$RC"
