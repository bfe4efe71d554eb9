"""`relayout bench migration` (docs/benchmarks.md): the stall a session sees when it moves between two
replicas of different layouts, live (pre-copy) vs cold (stop-and-copy) vs recompute (abort and
re-prefill on the target), at several context lengths.

Everything is measured from the client's side, on the session's own token stream: the stall
is the time from its last token on the source to its first token on the target. Each context
costs one prefill: the prompt on the target (its time to first token is the recompute move's
stall), checkpointed there after a few tokens; both moves start from that checkpoint restored on
the source, and the reference is the same checkpoint restored on the target, decoding undisturbed. A second,
short session decodes on the source through the live move's pre-copy rounds; its tokens/s
then, over its tokens/s just before, is `decode_ratio`.

The replicas are real `relayout serve` processes (source `attn_dp=1`, target `attn_tp=2`);
each migrated session's tokens are checked against the same greedy request run undisturbed
on the target (`tokens_match`).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from relayout.bench.migration_sessions import (
    MAX_TOKENS,
    Ctx,
    Log,
    attach_early,
    completion,
    prefill_on_target,
    prompt,
    reference,
    restored,
    wait_idle,
    warm_up,
)
from relayout.bench.replica_client import (
    BenchError,
    Replica,
    TokenStream,
    gaps,
    link_copy,
    link_gbps,
    median_gap_ms,
    split_cpus,
    tree_cpu_s,
)
from relayout.migrate.protocol.live import SMALL_ROUND_BYTES
from relayout.migrate.transport.base import precopy_nice

SOURCE_LAYOUT = "attn_dp=1"
TARGET_LAYOUT = "attn_tp=2"
DEFAULT_MODEL = "builtin:bench"
QUICK_MODEL = "builtin:tiny"
DEFAULT_CONTEXTS = (1024, 4096, 16384)
QUICK_CONTEXTS = (256, 1024)
MAX_ROUNDS = 64  # migrate_live's default, passed explicitly: the bench predicts its last pre-copy round
LOADED_PROBE_BYTES = 4 << 30  # at pre-copy's priority beside a decode: a cap; PROBE_STEPS decode steps long
PROBE_STEPS = 4  # the source's decode steps before the loaded-link probe (its baseline) and during it
# the probe's shortest window: a low-priority copy of a few short steps (builtin:tiny's ~10 ms) may
# not be scheduled at all on a busy machine, and would measure the scheduler rather than the link
MIN_PROBE_S = 0.5


def kv_bytes_per_token(model: str) -> int:
    from relayout.engine.model.config import ModelConfig
    from relayout.engine.model.weights import resolve_model

    c = ModelConfig.from_dir(resolve_model(model))
    return c.num_layers * c.num_kv_heads * c.head_dim * 4 * 2  # fp32, K and V


# ---- the measurements -------------------------------------------------------------------------------
def _wait_gone(url: str, sid: str | None, timeout: float = 10.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if sid not in {x["id"] for x in httpx.get(f"{url}/v1/replica", timeout=30).json()["sessions"]}:
            return
        time.sleep(0.02)


def measure_move(c: Ctx, mode: str, with_second: bool) -> dict:
    from relayout.migrate.protocol.live import MigrationPlan, migrate_live

    def reattach(src_stream: TokenStream) -> None:
        # the moment the source's stream ends without [DONE], follow the session on the target
        src_stream.follower = TokenStream(
            "GET", f"{c.dst}/v1/sessions/{src_stream.sid}/stream?from_token={len(src_stream.tokens)}"
            "&return_token_ids=true", stop_after=c.after, retry_404_s=10.0)

    s = restored(c, c.src, then=reattach)
    s.wait_tokens(s.restored_with + 2, c.timeout)  # decoding on the source before it moves
    loaded, loaded_decode = loaded_link(c, s) if with_second else (None, None)
    second = None
    base: list[tuple[float, float]] = []
    if with_second:
        # a short session decoding next to the long one; its gaps just before the move are the baseline
        second = TokenStream("POST", f"{c.src}/v1/completions", completion(prompt(32, salt=7), MAX_TOKENS))
        second.wait_tokens(2, c.timeout)
        t_base = second.times[-1]
        second.wait_tokens(len(second.tokens) + 6, c.timeout)
        base = [g for g in gaps(second.times) if g[0] >= t_base]
    attach, attached = attach_early(c.dst, s.sid)
    marks: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    def progress(phase: str, total: int) -> None:
        marks.append((phase, time.perf_counter()))
        if second is None or phase != "pre-copy":
            return
        pre = [m for m in marks if m[0] == "pre-copy"]
        last_bytes = total - progress.total  # type: ignore[attr-defined]
        progress.total = total  # type: ignore[attr-defined]
        if last_bytes <= SMALL_ROUND_BYTES or len(pre) >= MAX_ROUNDS:
            # the final round comes next: end the second session first, so that it does not compete
            # with the target for this machine's cores while the moved session resumes there
            second.stop()
            second.join(c.timeout)
            _wait_gone(c.src, second.sid)

    progress.total = 0  # type: ignore[attr-defined]
    cpu: dict[str, float] = {}  # both replicas' CPU seconds at the final round's start and end

    def on_phase(ph: str) -> None:
        # only the cold move's window is reported (round_window_cpu_s_per_gb): reading /proc costs this
        # process ~10 ms of a core, which in a live move would compete with the target's pre-step
        if ph in ("stop-and-copy", "prepared") and c.pids and mode == "cold":
            cpu[ph] = sum(tree_cpu_s(p) for p in c.pids)
        if ph == "stop-and-copy":
            attach()

    plan = MigrationPlan(mode=mode, max_rounds=MAX_ROUNDS, small_bytes=SMALL_ROUND_BYTES,
                         timeout_s=max(300.0, c.timeout), transport=c.transport)
    res = migrate_live(c.src, c.dst, [s.sid], plan=plan, progress=progress, on_phase=on_phase)
    t_done = time.perf_counter()
    s.finish(60)
    if s.done or not res.sessions:
        raise BenchError(f"{mode}: the session finished on the source before it moved "
                         f"(done={s.done}, res={res}, toks={len(s.tokens)})")
    k = len(s.tokens)
    t = s.follower
    assert t is not None
    t.wait_tokens(1, c.timeout)
    first_batch = t.times.count(t.times[0])
    t.finish(c.timeout)
    early = attached()
    out = {
        "loaded_link_gbps": round(loaded, 3) if loaded else None,
        "loaded_link_decode_ratio": loaded_decode,
        "stall_ms": round((t.times[0] - s.times[-1]) * 1000, 2),
        # the same, for a client that was already attached on the target when the session resumed there
        # (no reattach latency): how long the session itself produced nothing
        "stall_attached_ms": round((early.times[0] - s.times[-1]) * 1000, 2) if early and early.times else None,
        "server_stall_ms": round(res.stall_ms, 2),  # migrate_live: source hold -> target commit returned
        "final_round_ms": round(res.rounds[-1].seconds * 1000, 2),  # pause + export + transfer + import
        # the replicas' own account of it (migrate.protocol.live.PreCopyRound.timing): the source's wait for a
        # step boundary and cut, each side's CPU over its part, the target's receive and import
        "final_round_timing": res.rounds[-1].timing,
        # source + target CPU over the final round (cut, frame, hash, send, receive, verify, import)
        "final_round_cpu_s": round(cpu["prepared"] - cpu["stop-and-copy"], 3) if len(cpu) == 2 else None,
        # release + commit (resume), and its calls: the target check, the source's release, the commit
        "commit_ms": round(res.stall_ms - res.rounds[-1].seconds * 1000, 2), "commit_timing": res.commit_timing,
        # source hold -> first token there, as the target saw it (final round + commit + one target step)
        "resume_to_first_token_ms": round((t.times[0] - t_done) * 1000, 2),
        # where the client-side stall went: last source token -> source stream closed -> target stream
        # requested -> its headers -> first token
        "timeline_ms": {
            "source_stream_end": round((s.closed_at - s.times[-1]) * 1000, 2),
            "target_request": round((t.started_at - s.times[-1]) * 1000, 2),
            "target_headers": round(((t.opened_at or t.started_at) - s.times[-1]) * 1000, 2),
            "migrate_returned": round((t_done - s.times[-1]) * 1000, 2),
            "first_token": round((t.times[0] - s.times[-1]) * 1000, 2),
        },
        "rounds": [{"index": r.index, "bytes": r.bytes, "ms": round(r.seconds * 1000, 2), "final": r.final}
                   for r in res.rounds],
        "bytes": res.bytes_total,
        "migrate_ms": round((t_done - t0) * 1000, 2),
        "source_itl_ms": median_gap_ms(s.times),
        "target_itl_ms": median_gap_ms(t.times),
        "tokens_at_move": k,
        "first_target_batch": first_batch,  # >1: the bench attached late, the stall is overstated
    }
    c.sessions[mode] = s.tokens + t.tokens
    server = httpx.get(f"{c.dst}/v1/sessions/{s.sid}", timeout=30).json().get("token_ids", [])
    out["stream_matches_server"] = server[: len(c.sessions[mode])] == c.sessions[mode]
    if second is not None:
        # pre-copy: from the start of the move to the end of its last non-final round
        pre_end = max([t0] + [m for ph, m in marks if ph == "pre-copy"])
        second.stop()
        second.finish(c.timeout)
        during = [g for g in gaps(second.times) if g[1] > t0 and g[0] < pre_end]
        normal = statistics.mean(b - a for a, b in base) if base else None
        dur = statistics.mean(b - a for a, b in during) if during else None
        out["precopy_ms"] = round((pre_end - t0) * 1000, 2)
        out["decode_gaps_precopy"] = len(during)
        out["decode_ratio"] = round(normal / dur, 3) if normal and dur else None
    wait_idle(c.src, c.dst)
    return out


def loaded_link(c: Ctx, s: TokenStream) -> tuple[float, float | None]:
    """The link as pre-copy finds it: a plain socket copy, both ends at pre-copy's priority, for
    PROBE_STEPS of the source's decode steps (at least MIN_PROBE_S) while it decodes `s` alone (GB/s); and that decoding's
    rate meanwhile against its rate just before. A bare copy has no framing, hashing or pool copies:
    what it leaves of the decoding is the most any transport moving bytes at its rate can leave."""
    t_base = s.times[-1]
    s.wait_tokens(len(s.tokens) + PROBE_STEPS, c.timeout)
    base = [b - a for a, b in gaps(s.times) if a >= t_base]
    seconds = max(PROBE_STEPS * statistics.median(base), MIN_PROBE_S)
    cp = link_copy(LOADED_PROBE_BYTES, c.source_cpus, precopy_nice(), seconds=seconds)
    s.wait_tokens(len(s.tokens) + 1, c.timeout)  # the gap the copy ended in
    during = [b - a for a, b in gaps(s.times) if b > cp.started and a < cp.ended]
    return cp.gbps, round(statistics.mean(base) / statistics.mean(during), 3) if base and during else None


def precopy_transport(live: dict) -> tuple[int, float]:
    """(bytes, seconds) of a live move's pre-copy rounds (the final one excluded: it is the stall)."""
    pre = [r for r in live["rounds"] if not r["final"]]
    return sum(r["bytes"] for r in pre), sum(r["ms"] for r in pre) / 1000


def run_context(src: str, dst: str, L: int, *, warm: int, after: int, timeout: float, log: Log,
                checkpoint_dir: str, second: bool = True, transport: str | None = None,
                source_cpus: set[int] | None = None, pids: tuple[int, ...] = ()) -> dict:
    """`checkpoint_dir`: a file:// store both replicas may write and read (prefill_on_target)."""
    c = Ctx(src, dst, L, prompt(L), warm, after, timeout, log, transport=transport, checkpoint_dir=checkpoint_dir,
            source_cpus=source_cpus, pids=pids)
    log(f"context {L}: prefill on the target (recompute), checkpointed after {warm} tokens")
    rec = prefill_on_target(c)
    log(f"context {L}: recompute {rec['recompute_ms']:.1f} ms; live move (the session restored on the source)")
    live = measure_move(c, "live", with_second=second)
    log(f"context {L}: live stall {live['stall_ms']:.1f} ms; cold move")
    cold = measure_move(c, "cold", with_second=False)
    log(f"context {L}: cold stall {cold['stall_ms']:.1f} ms; undisturbed reference on the target")
    ref = reference(c)
    match = {m: toks == ref[: len(toks)] for m, toks in c.sessions.items()}
    # the cold round's yardstick: the same bytes over a bare socket, normal priority, nothing else running
    bare = link_copy(cold["bytes"], c.source_cpus, 0) if cold["bytes"] else None
    # and from and into memory of their own, as a round's chunks are (the above stays in the cache)
    bare_distinct = link_copy(cold["bytes"], c.source_cpus, 0, distinct=True) if cold["bytes"] else None
    cold_gb = cold["bytes"] / 1e9
    # the cold round's data path: from the sessions held on the source (its wait for the decode step
    # in flight to end, part of the stall, is not the path's) to the target's reply; its CPU is both
    # replicas' over their parts of it (the source from its cut, the target from its first byte to
    # its KV in the pool, before its first decode step there)
    tm = cold["final_round_timing"]
    cut_ms = tm.get("source_cut_ms")
    cold_s = (cold["final_round_ms"] - (cut_ms or 0)) / 1000
    path_cpu = tm["source_cpu_s"] + tm["target_cpu_s"] if {"source_cpu_s", "target_cpu_s"} <= tm.keys() else None
    moved, secs = precopy_transport(live)
    step = live["target_itl_ms"]
    out = {
        "live_stall_ms": live["stall_ms"],
        "cold_stall_ms": cold["stall_ms"],
        "live_stall_attached_ms": live["stall_attached_ms"],
        "cold_stall_attached_ms": cold["stall_attached_ms"],
        "recompute_ms": rec["recompute_ms"],
        "recompute_estimated": rec["estimated"],
        "target_step_ms": step,  # the target's decode step at this context (median gap after the move)
        "live_stall_steps": round(live["stall_ms"] / step, 2) if step else None,
        # a plain socket copy at pre-copy's priority while the source decodes this session: what
        # the link carries for pre-copy here, beside decoding (transport_gbps's yardstick under load)
        "loaded_link_gbps": live["loaded_link_gbps"],
        # the source's decode rate during that copy against just before it: the most of decode_ratio
        # a transport moving bytes at loaded_link_gbps could leave (a bare copy does no more work)
        "loaded_link_decode_ratio": live["loaded_link_decode_ratio"],
        "precopy_bytes": moved,
        "transport_gbps": round(moved / secs / 1e9, 3) if secs > 0 else None,
        # the cold move's one round (sessions paused, nothing else running): what the path moves alone
        **dict.fromkeys(("cold_transport_gbps", "cold_round_gbps"), round(cold_gb / cold_s, 3) if cold_s > 0 else None),
        "cold_cut_ms": cut_ms,  # the source's wait for a step boundary, then the cut (not in the two above)
        # the whole round, that wait included, as the migrator timed it
        "cold_round_with_cut_gbps": round(cold_gb / cold["final_round_ms"] * 1000, 3) if cold["final_round_ms"] else None,
        # CPU seconds per GB: the path's (source + target replicas over their parts of the cold round) and a bare copy's
        "cpu_s_per_gb": round(path_cpu / cold_gb, 3) if path_cpu is not None and cold_gb > 0 else None,
        # both replicas' process trees from the migrator's stop-and-copy to prepared: also the decode
        # step the cut waits for and the target's first step (it starts as the import returns)
        "round_window_cpu_s_per_gb": round(cold["final_round_cpu_s"] / cold_gb, 3)
        if cold.get("final_round_cpu_s") is not None and cold_gb > 0 else None,
        "bare_copy_gbps": round(bare.gbps, 3) if bare else None,
        "bare_cpu_s_per_gb": round(bare.cpu_s_per_gb(cold["bytes"]) or 0, 3) if bare else None,
        **({"bare_distinct_gbps": round(bd.gbps, 3), "bare_distinct_cpu_s_per_gb": round(bd.cpu_s_per_gb(cold["bytes"]) or 0, 3)}
           if (bd := bare_distinct) else {"bare_distinct_gbps": None, "bare_distinct_cpu_s_per_gb": None}),
        "bare_copy_decode_ratio": live["loaded_link_decode_ratio"],  # the bare copy at pre-copy's rate and nice
        "live_rounds": len(live["rounds"]),
        "live_bytes": live["bytes"],
        "cold_bytes": cold["bytes"],
        "tokens_match": all(match[m] for m in ("live", "cold")) and live["stream_matches_server"]
        and cold["stream_matches_server"],
        "tokens_match_detail": match,
        "decode_ratio": live.get("decode_ratio"),
        "live": live,
        "cold": cold,
        "recompute": rec,
    }
    return out


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def run(model: str | None = None, contexts: list[int] | None = None, quick: bool = False, device: str | None = None,
        log: Log = lambda s: None, hosts: str = "shared", transport: str | None = None) -> dict:
    """`hosts="split"`: the source replica on the first half of this process's CPUs, the target, the
    clients and the link probe's receiver on the other half (the probe's sender on the source's), as
    on two hosts; "shared": everything on every CPU."""
    if hosts not in ("split", "shared"):
        raise ValueError(f"hosts must be 'split' or 'shared', not {hosts!r}")
    mine = os.sched_getaffinity(0)
    src_cpus, dst_cpus = split_cpus(mine) if hosts == "split" and len(mine) >= 2 else (None, None)
    if dst_cpus:
        os.sched_setaffinity(0, dst_cpus)
    try:
        out = _run(model, contexts, quick, device, log, src_cpus, dst_cpus, transport)
    finally:
        os.sched_setaffinity(0, mine)
    out.update(hosts="split" if src_cpus else "shared", source_cpus=sorted(src_cpus or mine),
               target_and_client_cpus=sorted(dst_cpus or mine))
    return out


def _run(model: str | None, contexts: list[int] | None, quick: bool, device: str | None, log: Log,
         src_cpus: set[int] | None, dst_cpus: set[int] | None, transport_name: str | None = None) -> dict:
    model = model or (QUICK_MODEL if quick else DEFAULT_MODEL)
    contexts = sorted(contexts or (QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS))
    warm, after = (3, 4) if quick else (4, 8)
    per_tok = kv_bytes_per_token(model)
    # room for two sessions of the longest context at once (a move's two copies, the reference) + a short one
    kv_mb = max(8, math.ceil((2 * (max(contexts) + MAX_TOKENS) + 2 * MAX_TOKENS) * per_tok / 2**20) + 8)
    timeout = 600.0
    log(f"launching {model} replicas ({SOURCE_LAYOUT} -> {TARGET_LAYOUT}, {kv_mb} MiB KV each)")
    # the replicas' checkpoints (the live move's session, restored for the cold move) in memory where
    # it can: writing 1 GiB to a disk just before the live move would compete with it
    data = tempfile.TemporaryDirectory(prefix="relayout-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    env = {"RELAYOUT_DATA_DIR": data.name}
    reps = [Replica(model, SOURCE_LAYOUT, kv_mb, device, src_cpus, env),
            Replica(model, TARGET_LAYOUT, kv_mb, device, dst_cpus, env)]
    try:
        src, dst = (r.wait_ready() for r in reps)
        for url in (src, dst):  # a serving replica has run steps before anyone moves its sessions: the
            warm_up(url, timeout)  # first forward pass's one-time costs are not a migration's
        links = [link_gbps(sender_cpus=src_cpus)]
        log(f"link (plain TCP between two processes): {links[0]:.2f} GB/s")
        results: dict = {}
        for L in contexts:
            try:
                results[str(L)] = run_context(src, dst, L, warm=warm, after=after, timeout=timeout, log=log,
                                              transport=transport_name, source_cpus=src_cpus,
                                              pids=tuple(r.proc.pid for r in reps),
                                              checkpoint_dir=Path(data.name, f"checkpoints-{L}").as_uri())
                shutil.rmtree(Path(data.name, f"checkpoints-{L}"), ignore_errors=True)  # up to 1 GiB at 16k
            except Exception as e:  # noqa: BLE001 - with what the replicas said
                time.sleep(0.5)
                tails = "".join(f"--- {r.layout} replica:\n{''.join(r.tail[-15:])}" for r in reps)
                raise BenchError(f"context {L}: {type(e).__name__}: {e}\n{tails}") from e
        links.append(link_gbps(sender_cpus=src_cpus))  # once more at the end: the machine's load drifts during the run
    finally:
        for r in reps:
            r.stop()
        data.cleanup()
    lo, hi = results[str(contexts[0])], results[str(contexts[-1])]
    ratio = hi["decode_ratio"]
    link = statistics.median(links)
    moved = sum(r["precopy_bytes"] for r in results.values())
    secs = sum(precopy_transport(r["live"])[1] for r in results.values())
    transport = moved / secs / 1e9 if secs > 0 else None
    cold_gbps = [r["cold_transport_gbps"] for r in results.values() if r["cold_transport_gbps"]]
    loaded = [r["loaded_link_gbps"] for r in results.values() if r["loaded_link_gbps"]]
    loaded_link = statistics.median(loaded) if loaded else None
    bare = [r["loaded_link_decode_ratio"] for r in results.values() if r["loaded_link_decode_ratio"]]
    cpu = [r["cpu_s_per_gb"] for r in results.values() if r["cpu_s_per_gb"] is not None]
    bare_cpu = [r["bare_cpu_s_per_gb"] for r in results.values() if r["bare_cpu_s_per_gb"]]
    distinct_cpu, distinct_gbps = ([r[k] for r in results.values() if r[k]] for k in ("bare_distinct_cpu_s_per_gb",
                                                                                        "bare_distinct_gbps"))
    cold_round = max(cold_gbps) if cold_gbps else None
    out = {
        "link_gbps": round(link, 3),
        "link_gbps_samples": [round(x, 3) for x in links],
        "transport": transport_name or "tcp",  # how the source pushed the rounds
        "transport_gbps": round(transport, 3) if transport else None,
        "transport_vs_link": round(transport / link, 3) if transport else None,
        # pre-copy runs at a low CPU priority beside decoding (RELAYOUT_PRECOPY_NICE): the link at
        # that priority beside the same decoding (median over contexts), and pre-copy against it
        "loaded_link_gbps": round(loaded_link, 3) if loaded_link else None,
        "transport_vs_loaded_link": round(transport / loaded_link, 3) if transport and loaded_link else None,
        "loaded_link_vs_link": round(loaded_link / link, 3) if loaded_link else None,
        "loaded_link_decode_ratio": round(statistics.median(bare), 3) if bare else None,  # median over contexts
        # a cold round alone:
        "cold_transport_vs_link": round(max(cold_gbps) / link, 3) if cold_gbps else None,
        "cold_round_gbps": round(cold_round, 3) if cold_round else None,  # the best context's cold round
        # CPU seconds per GB moved (medians over contexts): the path (source + target, a cold round) and
        # a bare socket copy of the same bytes on this machine (both ends), and their ratio
        "cpu_s_per_gb": med(cpu),
        "bare_cpu_s_per_gb": med(bare_cpu),
        "cpu_vs_bare": round(med(cpu) / med(bare_cpu), 3) if cpu and bare_cpu else None,
        # against the bare copy of as many distinct bytes (a round's work less framing, hashing, pool copies)
        "bare_distinct_cpu_s_per_gb": med(distinct_cpu), "bare_distinct_gbps": med(distinct_gbps),
        "cpu_vs_bare_distinct": round(med(cpu) / med(distinct_cpu), 3) if cpu and distinct_cpu else None,
        "cold_round_vs_bare_distinct": round(cold_round / med(distinct_gbps), 3) if cold_round and distinct_gbps else None,
        "bare_copy_decode_ratio": round(statistics.median(bare), 3) if bare else None,
        "contexts": results,
        "decode_during_precopy_ratio": ratio,
        "model": model,
        "layouts": {"source": SOURCE_LAYOUT, "target": TARGET_LAYOUT},
        "kv_bytes_per_token": per_tok,
        "kv_cache_mb": kv_mb,
        "device": device or "default",
        "goals": {
            f"live_stall_{contexts[-1]}_le_1.5x_{contexts[0]}": hi["live_stall_ms"] <= 1.5 * lo["live_stall_ms"],
            f"live_stall_{contexts[-1]}_le_recompute_div_10": hi["live_stall_ms"] <= hi["recompute_ms"] / 10,
            "decode_during_precopy_ge_0.9": ratio is not None and ratio >= 0.9,
            "transport_vs_link_ge_0.5": transport is not None and transport / link >= 0.5,
            "cpu_s_per_gb_le_1.5x_bare": bool(cpu and bare_cpu and med(cpu) <= 1.5 * med(bare_cpu)),
            "cold_round_ge_0.6x_link": bool(cold_round and cold_round >= 0.6 * link),
            "decode_during_precopy_ge_0.95x_bare_copy": bool(ratio and bare and ratio >= 0.95 * statistics.median(bare)),
            "live_stall_le_1_step_plus_50ms": all(r["target_step_ms"] is not None and r["live_stall_ms"] <= r[
                "target_step_ms"] + 50 for r in results.values()),
        },
    }
    return out


def print_table(res: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"migration stall, {res['model']} {res['layouts']['source']} -> {res['layouts']['target']}")
    for col in ("context", "live ms", "live attached ms", "cold ms", "recompute ms", "rounds", "live MiB", "final round ms",
                "commit ms", "target step ms", "stall steps", "transport GB/s", "tokens match"):
        t.add_column(col, justify="right")
    for L, r in res["contexts"].items():
        t.add_row(L, f"{r['live_stall_ms']:.1f}", str(r["live_stall_attached_ms"]), f"{r['cold_stall_ms']:.1f}", f"{r['recompute_ms']:.1f}",
                  str(r["live_rounds"]), f"{r['live_bytes'] / 2**20:.1f}", f"{r['live']['final_round_ms']:.1f}",
                  f"{r['live']['commit_ms']:.1f}", str(r["target_step_ms"]), str(r["live_stall_steps"]),
                  str(r["transport_gbps"]), str(r["tokens_match"]))
    console.print(t)
    console.print(f"link {res['link_gbps']} GB/s (plain TCP); pre-copy transport ({res.get('transport', 'tcp')}) "
                  f"{res['transport_gbps']} GB/s "
                  f"= {res['transport_vs_link']} of the link; the link at pre-copy's priority beside decoding "
                  f"{res['loaded_link_gbps']} GB/s (pre-copy {res['transport_vs_loaded_link']} of it)")
    ratio = res["decode_during_precopy_ratio"]
    console.print(f"decode during pre-copy: {ratio if ratio is not None else 'n/a'} of normal tokens/s; during "
                  f"the bare copy at pre-copy's priority: {res['loaded_link_decode_ratio']}")
    console.print(f"cold round {res['cold_round_gbps']} GB/s, CPU s/GB {res['cpu_s_per_gb']}, bare {res['bare_cpu_s_per_gb']}, distinct bare {res['bare_distinct_cpu_s_per_gb']}")  # noqa: E501
    for goal, ok in res["goals"].items():
        console.print(f"  {goal}: {'met' if ok else 'NOT met'}")
