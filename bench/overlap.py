"""`relayout bench overlap`: how much of the experts' all-to-all the engine hides behind compute.

For each layout and batch size, the same greedy decode runs twice, with `overlap` off and
on (two micro-batches: one's exchange in flight while the other's experts compute). From
`expert_stats()` deltas over the decode steps only (prefill excluded), per step:
- exposed_s: seconds ranks sat waiting on the exchange (max over ranks, summed over layers);
- total_s: seconds the exchange was in flight (overlap off: equal to exposed_s).
hidden_fraction = 1 - exposed_on / total_off: the share of the plain exchange time that no
longer stalls anyone. Both runs must produce the same tokens (`tokens_match`).
Caveat: exposed_s counts waits only, not time spent inside the async issue call (with gloo
overlap-off total_s exceeds exposed_s by that), so `step_saved_fraction_raw` (step time
saved / exchange time off) is reported next to it as a wall-clock cross-check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.layout import Layout
from relayout.engine.model.weights import resolve_model
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams

LAYOUTS = ("attn_dp=2,moe_ep=2", "attn_tp=2,moe_ep=2", "attn_dp=2,moe_ep=2,redundant")
BATCHES = (4, 16)


def redundant(cfg: ModelConfig, ep: int) -> tuple[tuple[int, ...], ...]:
    """One extra slot per ep rank: rank r also holds the first expert of rank r+1 (EPLB-like)."""
    per = cfg.num_experts // ep
    row: list[int] = []
    for r in range(ep):
        row += list(range(r * per, (r + 1) * per)) + [((r + 1) % ep) * per]
    return tuple(tuple(row) for _ in range(cfg.num_layers))


def _layout(name: str, cfg: ModelConfig) -> Layout:
    if name.endswith(",redundant"):
        lay = Layout.parse(name.removesuffix(",redundant"))
        return replace(lay, placement=redundant(cfg, lay.moe_ep))
    return Layout.parse(name)


def _stats(eng: LLMEngine) -> list[dict]:
    return eng.executor.moe_stats()  # per rank: cumulative per-layer exposed_s / total_s


def _delta(a: list[dict], b: list[dict], key: str) -> float:
    """Per layer the slowest rank's increase (what expert_stats() reports), summed over layers.
    Deltas per rank first: the max of cumulative counters may switch ranks between reads."""
    layers = len(a[0][key])
    return sum(max(rb[key][i] - ra[key][i] for ra, rb in zip(a, b, strict=True)) for i in range(layers))


def _decode(eng: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(32, 127, (batch, prompt_len), generator=g).tolist()
    ss = [eng.add_session(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    eng.step()  # prefill (max_prefill_tokens covers the batch): not part of the decode figures
    s0 = _stats(eng)
    steps, start = 0, time.perf_counter()
    while eng.has_work():
        eng.step()
        steps += 1
    wall = time.perf_counter() - start
    s1 = _stats(eng)
    n = max(steps, 1)
    return {"exposed_s": _delta(s0, s1, "exposed_s") / n, "total_s": _delta(s0, s1, "total_s") / n, "step_s": wall / n, "steps": steps,
            "tokens": [s.output_token_ids for s in ss]}


def run(model: str = "builtin:bench", layouts: tuple[str, ...] = LAYOUTS, batches: tuple[int, ...] = BATCHES,
        prompt_len: int = 16, new_tokens: int = 16, quick: bool = False,
        log: Callable[[str], None] = print) -> dict:
    if quick:  # smoke-test size
        layouts, batches, new_tokens = layouts[:1], batches[:1], 4
    cfg = ModelConfig.from_dir(resolve_model(model))
    runs: dict[tuple[str, bool], dict[int, dict]] = {}
    for name in layouts:
        for overlap in (False, True):
            lay = replace(_layout(name, cfg), overlap=overlap)
            log(f"{name} overlap={'on' if overlap else 'off'}…")
            eng = LLMEngine(model, lay, max_prefill_tokens=max(batches) * prompt_len)
            try:
                _decode(eng, 2, prompt_len, 3)  # warm-up: first steps pay for lazy init
                runs[(name, overlap)] = {b: _decode(eng, b, prompt_len, new_tokens) for b in batches}
            finally:
                eng.shutdown()
    cases = []
    for name in layouts:
        for b in batches:
            off, on = runs[(name, False)][b], runs[(name, True)][b]
            raw = 1 - on["exposed_s"] / off["total_s"] if off["total_s"] > 0 else 0.0
            cases.append({
                "layout": name, "batch": b, "decode_steps": on["steps"],
                "off_exposed_ms": round(off["exposed_s"] * 1e3, 3), "off_total_ms": round(off["total_s"] * 1e3, 3),
                "on_exposed_ms": round(on["exposed_s"] * 1e3, 3), "on_total_ms": round(on["total_s"] * 1e3, 3),
                "off_step_ms": round(off["step_s"] * 1e3, 2), "on_step_ms": round(on["step_s"] * 1e3, 2),
                "hidden_fraction": round(min(1.0, max(0.0, raw)), 4), "hidden_fraction_raw": round(raw, 4),
                # cross-check from wall time: share of the plain exchange the step actually got back
                "step_saved_fraction_raw": round((off["step_s"] - on["step_s"]) / off["total_s"], 4)
                if off["total_s"] > 0 else 0.0,
                "tokens_match": off["tokens"] == on["tokens"],
            })
    best = max(cases, key=lambda c: c["hidden_fraction_raw"])
    return {"model": model, "threads": torch.get_num_threads(), "prompt_len": prompt_len, "new_tokens": new_tokens,
            "hidden_fraction": best["hidden_fraction"], "hidden_fraction_case": f"{best['layout']} batch {best['batch']}",
            "tokens_match": all(c["tokens_match"] for c in cases), "cases": cases}


def print_table(res: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"all-to-all overlap — {res['model']}, greedy decode, prompt {res['prompt_len']}, "
                    f"{res['new_tokens']} new tokens; ms per decode step (exposed = ranks waiting)")
    for col in ("layout", "batch", "off exposed", "on exposed", "on in flight", "off step", "on step",
                "hidden", "raw", "same tokens"):
        t.add_column(col, justify="right")
    for c in res["cases"]:
        t.add_row(c["layout"], str(c["batch"]), f"{c['off_exposed_ms']:.2f}", f"{c['on_exposed_ms']:.2f}",
                  f"{c['on_total_ms']:.2f}", f"{c['off_step_ms']:.1f}", f"{c['on_step_ms']:.1f}",
                  f"{c['hidden_fraction']:.0%}", f"{c['hidden_fraction_raw']:+.2f}", "yes" if c["tokens_match"] else "NO")
    console.print(t)
    console.print(f"hidden_fraction (best case, {res['hidden_fraction_case']}): {res['hidden_fraction']:.0%}")
