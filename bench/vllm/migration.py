"""`relayout bench vllm`: live migration of in-flight requests between stock vLLM replicas (docs/benchmarks.md).

Two `relayout serve --engine vllm` replicas of one model, TP1 (source) and TP2 (target) by default. Per context
length, side by side in one run:
- `target_step_ms`: the target's decode step (a completion's time after its first token / tokens);
- `reprefill_ms`: the target prefilling the whole context (a 1-token completion): what a request
  "migration" that re-prefills elsewhere (Dynamo, llm-d) pays, against `migrate_ms`, the whole live
  migration, and `live_stall_ms` (the session's pause, the final round to the target's resume),
  also as `live_stall_steps` (in target steps);
- `decode_during_precopy_ratio`: the source's token rate while the pre-copy rounds run, over its rate
  before the migration began (median inter-token gaps of the client's stream);
- `kv_bytes_moved` vs `kv_bytes` (the session's KV at the cut): the migration carries the KV, once;
- `exact`: the client's tokens, source then target, equal an undisturbed greedy run's;
- `imported_not_recomputed`: the target's vLLM computed at most a block of the moved request
  (`vllm:prompt_tokens_by_source_total{source="local_compute"}`).
Once per run, on the source: `step_during_export_ratio`, vLLM's decode step (the median inter-token gap
of a probe stream) without exports over the same while a long session is exported back to back
(checkpoints without stop): what an export costs every request on the replica.
`vllm snapshot` (vLLM 0.32) is reported with why it does not run here when it does not.
"""

from __future__ import annotations

import random
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from relayout.bench.replica_client import BenchError, QuietLoud, TokenStream, median_gap_ms
from relayout.bench.vllm.protection import decode_with_protection, failover
from relayout.migrate import procs
from rich.console import Console
from rich.table import Table

MAX_MODEL_LEN = 2048
LOCAL = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="local_compute"[^}]*\} ([0-9.e+]+)$', re.M)
SNAPSHOT_WHY = ("vllm snapshot create needs an immutable hub model (a repo id and a 40-character --revision; a "
                "local model directory is refused) and tensor parallel size 1, and restores onto the same host and "
                "layout only: it cannot run offline here nor move TP1 -> TP2")


def _replica(model_dir: Path, layout: str, kv_cache_mb: int, file_root: Path | None = None) -> procs.Proc:
    return procs.launch("serve", "--engine", "vllm", "--model", str(model_dir), "--port", "0", "--layout", layout,
                        "--kv-cache-mb", str(kv_cache_mb), "--vllm-args", f"--max-model-len {MAX_MODEL_LEN}",
                        env={"RELAYOUT_FILE_ROOTS": str(file_root)} if file_root else None, timeout=900)


def _local_compute(url: str) -> float:
    info = httpx.get(f"{url}/v1/replica", timeout=30).json()
    return sum(float(m) for m in LOCAL.findall(httpx.get(f"{info['engine_url']}/metrics", timeout=30).text))


def _complete(url: str, prompt: list[int], n: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True}, timeout=300)
    if r.status_code != 200:
        raise BenchError(f"completion on {url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]["token_ids"], time.perf_counter() - t0


MIN_GAPS = 8  # inter-token gaps a window needs for its median to say something


def measure_context(src: str, dst: str, ctx: int, kv_per_token: int, seed: int = 0) -> dict:
    from relayout.migrate.protocol.live import MigrationPlan, migrate_live

    rnd = random.Random(seed + ctx)
    prompt = [rnd.randrange(1, 500) for _ in range(ctx)]
    new = MAX_MODEL_LEN - ctx - 8
    ref, _ = _complete(src, prompt, new)  # undisturbed greedy tokens (and vLLM's caches warm)
    # the target's figures on other prompts of the same length: vLLM's prefix cache would serve a
    # repeated prompt (and the moved request, were it the same) without computing it
    others = [[rnd.randrange(1, 500) for _ in range(ctx)] for _ in range(4)]
    prefill = min(_complete(dst, q, 1)[1] for q in others[:3])
    _, t64 = _complete(dst, others[3], 65)
    step = max(1e-6, (t64 - prefill) / 64)
    before_local = _local_compute(dst)
    s = TokenStream("POST", f"{src}/v1/completions", {"prompt": prompt, "max_tokens": new, "temperature": 0,
                                                       "ignore_eos": True, "return_token_ids": True, "stream": True})
    s.wait_tokens(8, 120)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    res = migrate_live(src, dst, [s.sid] if s.sid else None, plan=MigrationPlan(transport="http"),
                       on_phase=lambda p: phases.setdefault(p.split(":")[0], time.perf_counter()))
    t1 = time.perf_counter()
    s.finish(120)
    moved = s.sid in res.sessions
    rest: list[int] = []
    if moved:
        follow = TokenStream("GET", f"{dst}/v1/sessions/{s.sid}/stream?from_token={len(s.tokens)}&return_token_ids=true")
        follow.finish(300)
        rest = follow.tokens
    final_at = phases.get("stop-and-copy", t1)
    before = [t for t in s.times if t < t0]
    during = [t for t in s.times if t0 <= t < final_at]
    # a median of a few gaps is noise (a stream's tokens come in bursts): 0.19, 332 and 0.59 in one run
    # whose pre-copy rounds lasted ~40 ms; fewer than MIN_GAPS in a window reports null
    g_before = median_gap_ms(before) if len(before) > MIN_GAPS else None
    g_during = median_gap_ms(during) if len(during) > MIN_GAPS else None
    cut_tokens = ctx + len([t for t in s.times if t < final_at])
    return {
        "moved": moved, "not_moved": res.not_moved, "exact": s.tokens + rest == ref,
        "target_step_ms": round(step * 1e3, 3), "reprefill_ms": round(prefill * 1e3, 2),
        "migrate_ms": round((t1 - t0) * 1e3, 2), "migrate_vs_reprefill": round((t1 - t0) / prefill, 3),
        "live_stall_ms": round(res.stall_ms, 2), "live_stall_steps": round(res.stall_ms / 1e3 / step, 2),
        "decode_during_precopy_ratio": round(g_before / g_during, 3) if g_before and g_during else None,
        "precopy_rounds": len(res.rounds) - 1, "kv_bytes_moved": res.bytes_total,
        "kv_bytes": kv_per_token * cut_tokens,
        "kv_moved_vs_size": round(res.bytes_total / (kv_per_token * cut_tokens), 3),
        # tokens the target computed for the moved request: its KV was imported (at most a block here)
        "target_local_compute_tokens": _local_compute(dst) - before_local,
    }


EXPORT_WINDOW_S = 0.4  # each window of a repetition; vLLM decodes ~1k tokens/s here, so a window holds hundreds
EXPORT_REPS = 5


def measure_step_during_export(src: str, ckpt_root: Path, seed: int = 0, max_model_len: int = MAX_MODEL_LEN) -> dict:
    """vLLM's decode step with and without a long session being exported, side by side per repetition."""
    import threading

    rnd = random.Random(seed)
    ctx = max_model_len // 2  # the long session: half the context in its prompt, decoding into the rest
    windows = QuietLoud()
    exports = 0
    for rep in range(EXPORT_REPS):
        long = TokenStream("POST", f"{src}/v1/completions", {
            "prompt": [rnd.randrange(1, 500) for _ in range(ctx)], "max_tokens": max_model_len - ctx - 8,
            "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True})
        probe = TokenStream("POST", f"{src}/v1/completions", {
            "prompt": [rnd.randrange(1, 500) for _ in range(16)], "max_tokens": max_model_len - 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True})
        long.wait_tokens(4, 120)
        probe.wait_tokens(8, 120)
        t0 = time.perf_counter()
        time.sleep(EXPORT_WINDOW_S)
        t1 = time.perf_counter()
        stop = threading.Event()

        def export_loop(sid: str = long.sid or "", n: int = rep, stop: threading.Event = stop) -> None:
            nonlocal exports
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    r = c.post(f"{src}/v1/sessions/checkpoint", json={
                        "sessions": [sid], "stop": False, "destination": (ckpt_root / f"r{n}").as_uri()})
                    if r.status_code != 200:
                        return  # the session ended: the window closes with what it has
                    exports += 1

        th = threading.Thread(target=export_loop, daemon=True)
        th.start()
        time.sleep(EXPORT_WINDOW_S)
        t2 = time.perf_counter()
        stop.set()
        th.join(60)
        probe.stop()
        long.stop()
        probe.finish(120)
        long.finish(120)
        windows.add(probe.times, t0, t1, t2)
    g_quiet, g_loud, ratio = windows.gaps_ms()
    return {"step_ms_without_export": g_quiet, "step_ms_during_export": g_loud, "exports": exports,
            "step_during_export_ratio": ratio}


def run(model: str | None, contexts: list[int], log: Callable[[str], None] = print, kv_cache_mb: int = 1024,
        source_layout: str = "attn_tp=1", target_layout: str = "attn_tp=2,moe_tp=2") -> dict:
    from relayout.engine.vllm.server import vllm_version

    if vllm_version() is None:
        raise BenchError("vLLM is not installed here (pip install -e '.[vllm]')")
    for c in contexts:
        if not 16 <= c <= MAX_MODEL_LEN - 64:
            raise ValueError(f"--contexts: {c} must be in 16..{MAX_MODEL_LEN - 64} (max model length {MAX_MODEL_LEN})")
    with tempfile.TemporaryDirectory(prefix="relayout-bench-vllm-") as tmp:
        if model is None:
            from relayout.bench.vllm.model import make_tiny_qwen3_moe

            model_dir = make_tiny_qwen3_moe(Path(tmp) / "tiny-qwen3-moe", MAX_MODEL_LEN)
            name = "tiny Qwen3-MoE (hidden 128, 2 layers, 8 experts, head_dim 64)"
        else:
            model_dir, name = Path(model), model
        log(f"launching vLLM replicas: {source_layout} (source), then {target_layout} (target)")
        src = _replica(model_dir, source_layout, kv_cache_mb, Path(tmp))
        try:
            dst = _replica(model_dir, target_layout, kv_cache_mb)
            try:
                info = httpx.get(f"{src.url}/v1/replica", timeout=30).json()
                per_tok = int(info["kv_bytes_per_token"])
                out: dict = {"bench": "vllm", "model": name, "engine_version": info.get("engine_version"),
                             "source_layout": source_layout, "target_layout": target_layout,
                             "kv_bytes_per_token": per_tok, "contexts": {},
                             "vllm_snapshot": None, "vllm_snapshot_why": SNAPSHOT_WHY}
                for c in contexts:
                    log(f"context {c}")
                    out["contexts"][str(c)] = measure_context(src.url, dst.url, c, per_tok)
                log("vLLM's decode step during exports")
                out.update(measure_step_during_export(src.url, Path(tmp) / "exports"))
                log(f"protection {source_layout} -> {target_layout}: the source's decode, then a kill -9 and failover")
                out.update(decode_with_protection(src.url, dst.url, MAX_MODEL_LEN - 128))
                out.update(failover(src.url, dst.url, lambda sig: procs.kill_tree(src.pid, sig), MAX_MODEL_LEN - 128))
                return out
            finally:
                dst.stop(30)
        finally:
            src.stop(30)


def print_table(res: dict, console: Console) -> None:
    t = Table(title=f"vLLM live migration {res['source_layout']} -> {res['target_layout']} ({res['model']})")
    for col in ("context", "stall ms", "target step ms", "stall steps", "migrate ms", "re-prefill ms",
                "decode during pre-copy", "KV moved / size", "exact"):
        t.add_column(col, justify="right")
    for c, r in res["contexts"].items():
        t.add_row(c, f"{r['live_stall_ms']:.1f}", f"{r['target_step_ms']:.2f}", f"{r['live_stall_steps']:.1f}",
                  f"{r['migrate_ms']:.0f}", f"{r['reprefill_ms']:.1f}", str(r["decode_during_precopy_ratio"]),
                  f"{r['kv_moved_vs_size']:.2f}", "yes" if r["exact"] and r["moved"] else "NO")
    console.print(t)
    console.print(f"vLLM's decode step during a long session's exports: {res.get('step_ms_during_export')} ms against "
                  f"{res.get('step_ms_without_export')} ms without (step_during_export_ratio "
                  f"{res.get('step_during_export_ratio')}, {res.get('exports')} exports)")
    console.print(f"protection: the source decodes at {res.get('decode_ratio_with_protection')} of its unprotected "
                  f"rate ({res.get('step_ms_protected')} vs {res.get('step_ms_unprotected')} ms a step, "
                  f"{res.get('protection_rounds')} rounds); kill -9 to the standby's first token: "
                  f"{res.get('failover_ms')} ms (lease {res.get('failover_lease_s')} s; "
                  f"{'exact' if res.get('failover_exact') else 'NOT exact'})")
    console.print(f"vllm snapshot: {res['vllm_snapshot_why']}")
