"""Attention split chooser: attn_dp x attn_tp for the observed concurrency.

TP splits every sequence's attention over ranks (low latency at small batches, but every rank
works on every sequence); DP gives each rank its own sequences (more throughput once batches
are large). Which wins is an empirical question, so we decide from step times measured on
our own engine: measurements["attn_dp=A,attn_tp=T"] = {batch: step_ms}, batch = sequences
decoding together in the whole replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class AttentionChoice:
    attn_dp: int
    attn_tp: int
    step_ms: float  # expected step time at the observed concurrency
    tokens_per_s: float  # best throughput within the latency target (or at the concurrency)
    meets_target: bool
    reason: str


def _parse(key: str) -> tuple[int, int]:
    d = dict(part.split("=", 1) for part in key.replace(" ", "").split(","))
    return int(d["attn_dp"]), int(d["attn_tp"])


def _interp(points: dict[int, float], batch: float) -> float:
    """Step time at `batch`, linear between measured batches and extrapolated past the ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if batch <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif batch >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        lo = max(x for x in xs if x <= batch)
        hi = min(x for x in xs if x >= batch)
        if lo == hi:
            return points[lo]
    t = points[lo] + (points[hi] - points[lo]) * (batch - lo) / (hi - lo)
    return max(t, 1e-6)


def choose_attention_split(world_size: int, concurrency: int, latency_target_ms: float,
                           measurements: dict[str, dict]) -> AttentionChoice:
    """The split meeting the latency target at `concurrency` with the highest throughput
    (sustainable at >= concurrency within the target); if none meets it, the fastest one."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    rows: list[tuple[int, int, float, float, bool]] = []
    for key, pts in measurements.items():
        dp, tp = _parse(key)
        if dp * tp != world_size or not pts:
            continue  # measured for another world size
        pts = {int(b): float(ms) for b, ms in pts.items()}
        step = _interp(pts, concurrency)
        meets = step <= latency_target_ms
        # headroom: the most tokens/s at a batch >= concurrency still inside the target
        tput = concurrency * 1000 / step
        for b, ms in pts.items():
            if b >= concurrency and ms <= latency_target_ms:
                tput = max(tput, b * 1000 / ms)
        rows.append((dp, tp, step, tput, meets))
    if not rows:
        raise ValueError(f"no measurements for a split with attn_dp*attn_tp = {world_size} "
                         f"(have {sorted(measurements)})")
    ok = [r for r in rows if r[4]]
    if ok:
        dp, tp, step, tput, _ = max(ok, key=lambda r: (r[3], -r[2]))
        why = (f"attn_dp={dp},attn_tp={tp} meets the {latency_target_ms:g} ms step target at concurrency "
               f"{concurrency} ({step:.1f} ms) with the highest throughput ({tput:.0f} tokens/s) of "
               f"{len(ok)} split(s) that meet it")
    else:
        dp, tp, step, tput, _ = min(rows, key=lambda r: r[2])
        why = (f"no split meets the {latency_target_ms:g} ms step target at concurrency {concurrency}; "
               f"attn_dp={dp},attn_tp={tp} has the lowest step time ({step:.1f} ms)")
    return AttentionChoice(dp, tp, step, tput, bool(ok), why)


def measure_attention_splits(model: str, world: int, batches: list[int], steps: int = 4,
                             prompt_len: int = 16) -> dict[str, dict[int, float]]:
    """Time decode steps of our engine under every attn_dp x attn_tp split of `world` ranks.
    Slow (launches one replica per split); for `relayout plan`, not for unit tests."""
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams

    out: dict[str, dict[int, float]] = {}
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        dp = world // tp
        key = f"attn_dp={dp},attn_tp={tp}"
        try:
            eng = LLMEngine(model, f"attn_dp={dp},attn_tp={tp},moe_ep={world},moe_tp=1")
        except ValueError:
            continue  # split impossible for this model (e.g. tp does not divide the heads)
        try:
            out[key] = {}
            for b in batches:
                for i in range(b):
                    eng.add_session([(7 * i + j) % 200 + 1 for j in range(prompt_len)],
                                    SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
                eng.step()  # prefill
                t0 = time.perf_counter()
                n = 0
                while eng.has_work() and n < steps:
                    eng.step()
                    n += 1
                out[key][b] = (time.perf_counter() - t0) * 1000 / max(n, 1)
                while eng.has_work():
                    eng.step()
        finally:
            eng.shutdown()
    return out
