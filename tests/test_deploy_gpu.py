"""deploy/ for vLLM and GPU nodes: the Kubernetes sidecar example (relayout attached to a user's vLLM)
and the GPU check scripts, run here without a GPU (every step they can, the CUDA ones skipped)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.test_deploy import DEPLOY, K8S_VERSIONS, _one, render


def test_k8s_vllm_sidecar_example_is_valid_and_shares_the_exchange():
    """deploy/k8s/examples/vllm-sidecar: a user's vLLM with relayout attached, strict-valid, the two
    containers sharing a memory-backed exchange that relayout's init container fills."""
    docs = render(DEPLOY / "k8s" / "examples" / "vllm-sidecar")
    dep = _one(docs, "Deployment", "vllm-qwen3-moe")
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(dep, K8S_VERSIONS[0], strict=True)
    spec = dep["spec"]["template"]["spec"]
    vol = next(v for v in spec["volumes"] if v["name"] == "exchange")
    assert vol["emptyDir"]["medium"] == "Memory"
    init = spec["initContainers"][0]
    assert "relayout vllm-config --exchange /exchange" in " ".join(init["command"])
    vllm, side = (next(c for c in spec["containers"] if c["name"] == n) for n in ("vllm", "relayout"))
    assert "--kv-transfer-config" in " ".join(vllm["args"])
    assert side["args"][:4] == ["serve", "--engine", "vllm", "--attach"] and "--exchange" in side["args"]
    for c in (init, vllm, side):
        assert any(m["name"] == "exchange" and m["mountPath"] == "/exchange" for m in c["volumeMounts"])


@pytest.mark.slow
def test_gpu_checks_run_to_exit_0_without_a_gpu(tmp_path):
    """deploy/gpu/run_gpu_checks.sh on this CPU machine: relayout importable from the install it makes or
    finds, every step it can run passes, the CUDA ones reported skipped, exit 0 (so it cannot rot)."""
    import sys

    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "DEADLINE_S": "400"}
    r = subprocess.run(["bash", str(DEPLOY / "gpu" / "run_gpu_checks.sh")], env=env, capture_output=True,
                       text=True, timeout=600)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert r.returncode == 0, summary + r.stderr[-2000:]
    env_log = (tmp_path / "out" / "env.log").read_text()
    assert "import relayout ok" in env_log and "discover():" in env_log, env_log[-2000:]
    for step in ("pytest_cuda", "bench_snapshot", "bench_migration"):
        assert f"SKIP {step}: no CUDA GPU here" in summary, summary
    assert "pytest_more rc=0" in summary and "every step that ran passed" in summary, summary


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_gpu_check_runs_its_cpu_part_without_a_gpu(tmp_path):
    """deploy/gpu/vllm_gpu_check.sh on vLLM's CPU build: the round trip runs (its difference reported), the
    forced preemption happens and keeps every token, the step during an export is measured; the CUDA-only
    checks are skipped."""
    import json
    import sys
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm]')")
    out = tmp_path / "results.json"
    r = subprocess.run(["bash", str(DEPLOY / "gpu" / "vllm_gpu_check.sh"), "--json", str(out)],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["preemption"]["result"] == "pass", res
    assert res["round_trip"]["max_abs_diff"] < 1e-4, res  # measured; bit-exactness is asserted on CUDA only
    assert res["preemption"]["preemptions"] > 0 and res["step_during_export"]["exports"] > 0, res
    assert all(v["result"] == "skipped" for k, v in res.items() if k.startswith("round_trip_flash")), res
