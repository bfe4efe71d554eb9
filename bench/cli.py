"""`relayout bench ...`: the benchmarks and the soak test as a typer app (docs/benchmarks.md).

The product does not import this module: `relayout.agent.cli` adds `bench_app` as the `bench`
sub-command because pyproject.toml registers it under the `relayout.commands` entry point group.
Each command imports its bench lazily, so `relayout --help` stays fast."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks, measured side by side in one run.")

err = Console(stderr=True)


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(code)


@bench_app.command("engine")
def bench_engine(
    model: str = typer.Option("builtin:bench", "--model", "-m"),
    new_tokens: int = typer.Option(32, "--new-tokens", help="tokens generated per sequence"),
    prompt_len: str = typer.Option("32,512", "--prompt-len", help="prompt lengths to measure, comma-separated"),
    threads: int = typer.Option(None, "--threads", help="torch CPU threads for both sides (default: torch's)"),
    reps: int = typer.Option(2, "--reps", help="best of this many runs per figure"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16, both sides"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Decode tokens/s of this engine vs Hugging Face transformers generate (batch 1 and 16)."""
    from relayout.bench import engine as be

    try:
        lens = [int(x) for x in prompt_len.split(",") if x.strip()]
        res = be.run(model, new_tokens=new_tokens, prompt_len=lens, threads=threads, reps=max(1, reps),
                     log=err.print, dtype=dtype)
    except be.MissingDependency as e:
        _fail(str(e))
    except ValueError as e:
        _fail(str(e))
    be.print_table(res, Console())
    if as_json:
        print(json.dumps(res), flush=True)


@bench_app.command("migration")
def bench_migration(
    model: str = typer.Option(None, "--model", "-m", help="default builtin:bench (builtin:tiny with --quick)"),
    contexts: str = typer.Option(None, "--contexts", help="context lengths in tokens, e.g. 1024,4096,16384"),
    quick: bool = typer.Option(False, "--quick", help="short contexts (256,1024) on builtin:tiny"),
    device: str = typer.Option(None, "--device", help="the replicas' device (default: cuda when present)"),
    hosts: str = typer.Option("shared", "--hosts", help="split: the source on half the CPUs, the target and "
                              "clients on the other half (two hosts); shared: all on every CPU"),
    transport: str = typer.Option(None, "--transport", help="how the source pushes the rounds: tcp (default, "
                                  "the frame link), http or mooncake (pip install 'relayout\\[mooncake]')"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Stall per session for live, cold and recompute moves between two layouts, at several context lengths."""
    if hosts not in ("split", "shared"):
        _fail(f"--hosts must be split or shared, not {hosts!r}")
    if transport not in (None, "http", "tcp", "mooncake"):
        _fail(f"--transport must be http, tcp or mooncake, not {transport!r}")
    from relayout.bench import migration as bm

    try:
        ctx = [int(x) for x in contexts.split(",") if x.strip()] if contexts else None
    except ValueError:
        _fail(f"--contexts must be comma-separated integers, got {contexts!r}")
    if ctx is not None and (not ctx or min(ctx) < 16):
        _fail("--contexts needs at least one length of 16 tokens or more")
    try:
        res = bm.run(model, ctx, quick=quick, device=device, log=err.print, hosts=hosts, transport=transport)
    except bm.BenchError as e:
        _fail(str(e), 1)
    bm.print_table(res, Console(stderr=as_json))
    if as_json:
        print(json.dumps(res), flush=True)


@bench_app.command("vllm")
def bench_vllm(
    model: str = typer.Option(None, "--model", "-m", help="an HF MoE model directory vLLM serves (default: a tiny "
                              "Qwen3-MoE made here)"),
    contexts: str = typer.Option("256,1024,1536", "--contexts", help="context lengths in tokens, comma-separated"),
    kv_cache_mb: int = typer.Option(1024, "--kv-cache-mb", help="each replica's KV cache"),
    source_layout: str = typer.Option("attn_tp=1", "--source-layout"),
    target_layout: str = typer.Option("attn_tp=2,moe_tp=2", "--target-layout", help="e.g. attn_tp=1 on one GPU"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Live migration between stock vLLM replicas (TP1 -> TP2): stall vs the target's step, migrate time vs
    re-prefill, source decode during pre-copy, KV bytes moved vs the KV's size."""
    from relayout.bench.vllm.migration import migration as bv

    try:
        res = bv.run(model, [int(x) for x in contexts.split(",") if x.strip()], log=err.print,
                     kv_cache_mb=kv_cache_mb, source_layout=source_layout, target_layout=target_layout)
    except (ValueError, bv.BenchError) as e:
        _fail(str(e))
    bv.print_table(res, Console(stderr=as_json, width=160))
    if as_json:
        print(json.dumps(res), flush=True)


@bench_app.command("replication")
def bench_replication(
    model: str = typer.Option("builtin:tiny", "--model", "-m"),
    every_tokens: int = typer.Option(16, "--every-tokens", help="the protection's sync interval in tokens"),
    sessions: int = typer.Option(8, "--sessions", help="concurrent sessions"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="tokens per session in the decode measurement"),
    reps: int = typer.Option(5, "--reps", help="pairs of runs (unprotected, then protected); the median ratio"),
    device: str = typer.Option(None, "--device", help="the replicas' device (default: cuda when present)"),
    hosts: str = typer.Option("split", "--hosts", help="split: the source on half the CPUs, the standby and "
                              "clients on the other half (two hosts); shared: all on every CPU"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Decode tokens/s protected vs unprotected, replication lag, and a kill -9 failover (lost/repeated/changed)."""
    from relayout.bench import replication as br

    if hosts not in ("split", "shared"):
        _fail(f"--hosts must be split or shared, not {hosts!r}", 2)
    res = br.run(model, every_tokens, max(1, sessions), max(16, max_tokens), max(1, reps), device, log=err.print,
                 hosts=hosts)
    br.print_table(res, Console(stderr=as_json))
    if as_json:
        print(json.dumps(res), flush=True)


@bench_app.command("overlap")
def bench_overlap(
    model: str = typer.Option("builtin:bench", "--model", "-m"),
    new_tokens: int = typer.Option(16, "--new-tokens", help="decode steps per run"),
    quick: bool = typer.Option(False, "--quick", help="one layout, one batch, a few steps (smoke test)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Share of the experts' all-to-all hidden by two-micro-batch overlap (off vs on, same decode)."""
    from relayout.bench import overlap as bo

    res = bo.run(model, new_tokens=new_tokens, quick=quick, log=err.print)
    bo.print_table(res, Console())
    if as_json:
        print(json.dumps(res), flush=True)


@bench_app.command("snapshot")
def bench_snapshot(
    model: str = typer.Option("builtin:bench", "--model", "-m"),
    sessions: int = typer.Option(4, "--sessions"),
    tokens: int = typer.Option(2048, "--tokens", help="KV tokens per session"),
    reps: int = typer.Option(3, "--reps", help="best of this many tries per figure"),
    quick: bool = typer.Option(False, "--quick", help="tiny sizes (smoke test)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """GB/s to snapshot and restore session KV next to a plain memory copy; codec ratios."""
    from relayout.bench import snapshot as bs

    res = bs.run(model, sessions=sessions, tokens=tokens, reps=max(1, reps), quick=quick, log=err.print)
    bs.print_table(res, Console())
    if as_json:
        print(json.dumps(res), flush=True)


@bench_app.command("datapath")
def bench_datapath(
    tokens: int = typer.Option(4096, "--tokens", help="KV tokens of the session moved (64 KiB each)"),
    target_heads: str = typer.Option("4,4", "--target-heads", help="the target's pools' KV heads (of 8), e.g. 8 or 4,4"),
    reps: int = typer.Option(3, "--reps", help="best of this many rounds (and bare copies)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """A cold round's data path alone (in-place send, placed on arrival) beside a bare copy: CPU per GB each side."""
    from relayout.bench import datapath as bd

    try:
        split = [int(x) for x in target_heads.split(",") if x.strip()]
        res = bd.run(tokens=tokens, split=split, reps=max(1, reps), log=err.print)
    except ValueError as e:
        _fail(str(e))
    Console().print(f"path {res['gbps']} GB/s, CPU s/GB sender {res['sender_cpu_s_per_gb']} + receiver "
                    f"{res['receiver_cpu_s_per_gb']} = {res['cpu_s_per_gb']}; bare copy {res['bare_gbps']} GB/s, "
                    f"{res['bare_cpu_s_per_gb']} CPU s/GB ({res['cpu_vs_bare']}x)")
    if as_json:
        print(json.dumps(res), flush=True)


@bench_app.command("placement")
def bench_placement(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
    engine_trace: bool = typer.Option(True, "--engine-trace/--no-engine-trace",
                                      help="also plan a trace recorded from builtin:tiny"),
    engine: bool = typer.Option(False, "--engine", help="instead: run planned placements in a real multi-rank "
                                                        "replica and report measured balance and cross-rank "
                                                        "traffic next to the planner model's prediction"),
) -> None:
    """Balance and cross-node traffic of the planner's placement vs DeepSeek's EPLB (both policies)."""
    if engine:
        from relayout.bench import placement_engine

        res = placement_engine.run(log=lambda m: Console(stderr=True).print(m))
        placement_engine.print_table(res, Console(stderr=as_json))
        if as_json:
            print(json.dumps(res), flush=True)
        return
    from relayout.bench.placement import run_bench

    run_bench(json_out=as_json, include_engine=engine_trace)


@bench_app.command("soak")
def bench_soak(
    count: int = typer.Option(20, "--count", "-n", min=1, max=10000, help="migrations (back and forth)"),
    layouts: str = typer.Option("attn_dp=1;attn_tp=2", "--layouts", help="the two layouts, separated by ';'"),
    sessions: int = typer.Option(4, "--sessions", min=1, max=64, help="sessions running during each migration"),
    max_tokens: int = typer.Option(48, "--max-tokens", min=8, max=4096),
    model: str = typer.Option("builtin:tiny", "--model", "-m"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Migrate running sessions back and forth between two layouts COUNT times; report whether RSS,
    file descriptors, processes and KV blocks return to their baseline (exit 1 on a leak)."""
    from relayout.bench import soak

    lays = [x.strip() for x in layouts.split(";") if x.strip()]
    if len(lays) != 2:
        _fail("--layouts needs exactly two layouts, e.g. 'attn_dp=1;attn_tp=2'")
    res = soak.run(count, (lays[0], lays[1]), sessions, max_tokens, model, log=err.print)
    for k in ("a", "b"):
        b, f = res["baseline"][k], res["final"][k]
        err.print(f"replica {k} ({res['layouts'][0 if k == 'a' else 1]}): RSS {b['rss_mb']} -> {f['rss_mb']} MiB, "
                  f"fds {b['fds']} -> {f['fds']}, processes {b['processes']} -> {f['processes']}, "
                  f"KV blocks {b['kv_blocks_used']} -> {f['kv_blocks_used']}")
    err.print(f"{res['migrations']} migrations ({res['failed']} failed), {res['sessions_moved']} sessions moved, "
              f"{res['mismatches']} changed outputs, stall p50 {res['stall_ms_p50']} ms; "
              + ("no leaks" if not res["leaks"] else "LEAKS: " + "; ".join(res["leaks"])))
    if as_json:
        print(json.dumps(res), flush=True)
    if not res["ok"]:
        raise typer.Exit(1)
