"""The replica's flags, defined once: `relayout serve` (agent.cli registers `serve_command`) and
`python -m relayout.migrate.replica.serve` (what the agent and procs launch; `main`) parse the same options
the same way. Light on purpose: the `relayout` CLI imports this for its help, so the engine (and
torch) is imported only when a replica starts."""

from __future__ import annotations

import shlex

import typer
from relayout.engine.command import fail, run_as_main


def int_list(value: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        fail(f"{what} must be comma-separated integers, got {value!r}")
    return out


def check_dtypes(dtype: str | None, kv_dtype: str | None) -> None:
    from relayout.engine.model.config import check_dtype, parse_kv_dtype

    for flag, check, value in (("--dtype", check_dtype, dtype), ("--kv-dtype", parse_kv_dtype, kv_dtype)):
        try:
            check(value)
        except ValueError as e:
            fail(f"{flag}: {e}")


def serve_command(
    model: str = typer.Option("builtin:tiny", "--model", "-m", help="builtin:NAME or a Hugging Face model directory"),
    layout: str = typer.Option(None, "--layout", "-l", help="e.g. attn_dp=2,attn_tp=1,moe_ep=2,moe_tp=1 (or JSON)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", help="0 picks a free port (the printed URL shows it)"),
    kv_cache_mb: int = typer.Option(None, "--kv-cache-mb", help="KV cache size per attention-DP group"),
    device: str = typer.Option(None, "--device", help="cuda, cuda:1, cpu (default: cuda when present)"),
    dtype: str = typer.Option(None, "--dtype", help="weights and activations: float32, bfloat16, float16 "
                                                   "(default: bfloat16 on CUDA, float32 on the CPU)"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache: auto (the model dtype) or fp8_e4m3"),
    local_ranks: str = typer.Option(None, "--local-ranks",
                                    help="ranks to run on this host, e.g. 0,1 (default: all); the others join "
                                         "from other hosts with `relayout rank`"),
    rank_endpoint: str = typer.Option(None, "--rank-endpoint",
                                      help="HOST:PORT where ranks join this driver (remote ranks' "
                                           "MASTER_ADDR:MASTER_PORT); default 127.0.0.1 and a free port"),
    standby: str = typer.Option(None, "--standby", help="replicate this replica's sessions continuously to the "
                                                       "standby replica at URL (promoted there if this one dies)"),
    api_key: list[str] = typer.Option([], "--api-key", help="a client API key (repeatable; default "
                                                          "RELAYOUT_API_KEYS, comma-separated; none: open)"),
    engine: str = typer.Option("builtin", "--engine", help="builtin (relayout's reference engine) or vllm (the "
                                                          "installed stock vLLM server; --model is an HF directory)"),
    vllm_args: str = typer.Option("", "--vllm-args", help='more arguments for vLLM\'s server, as one string, '
                                                         'e.g. "--max-model-len 4096"'),
    attach: str = typer.Option(None, "--attach", help="with --engine vllm: serve in front of the vLLM server at "
                                                     "URL you started (never started or stopped here)"),
    exchange: str = typer.Option(None, "--exchange", help="with --attach: the exchange directory of its relayout "
                                                         "connector (`relayout vllm-config --exchange DIR`)"),
) -> None:
    """Serve one model replica with an OpenAI-compatible API; prints its URL once listening."""
    from relayout.engine.model.config import ModelConfigError
    from relayout.engine.model.layout import LayoutError
    from relayout.engine.model.weights import ModelNotFoundError
    from relayout.engine.ranks.workers import RankFailure
    from relayout.engine.vllm.exchange import ExchangeError
    from relayout.engine.vllm.server import VllmUnavailable
    from relayout.migrate.replica.serve import rank_placement, serve

    if engine not in ("builtin", "vllm"):
        fail(f"--engine must be builtin or vllm, not {engine!r}")
    if kv_cache_mb is not None and kv_cache_mb < 1:
        fail("--kv-cache-mb must be at least 1")
    check_dtypes(dtype, kv_dtype)
    ranks = None if local_ranks is None else int_list(local_ranks, "--local-ranks")
    try:
        placement = rank_placement(ranks, rank_endpoint)
    except ValueError as e:
        fail(f"--rank-endpoint: {e}")
    try:
        serve(model, layout, host, port, kv_cache_mb=kv_cache_mb, device=device, placement=placement, dtype=dtype,
              kv_dtype=kv_dtype, standby=standby, api_keys=api_key or None, engine_kind=engine,
              vllm_args=shlex.split(vllm_args), attach=attach, exchange=exchange)
    except (LayoutError, ModelNotFoundError, ModelConfigError, RankFailure, ValueError, VllmUnavailable,
            ExchangeError) as e:
        fail(str(e))


def main(argv: list[str] | None = None) -> None:
    """`python -m relayout.migrate.replica.serve`: the flags of `relayout serve`."""
    run_as_main(serve_command, "python -m relayout.migrate.replica.serve", argv)
