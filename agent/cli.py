"""The `relayout` command line (SPEC §8).

One function per subcommand; the work lives in the modules they import lazily, so
`relayout --help` stays fast. Other subcommands (agent, gateway, checkpoint, restore,
migrate, drain, plan) are added below as `@app.command()`s or sub-apps; new benchmarks
are `@bench_app.command()`s next to `bench engine`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Checkpoint and live-migrate the in-flight sessions of MoE serving replicas.")
model_app = typer.Typer(no_args_is_help=True, help="Model files.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks, measured side by side in one run (SPEC §9).")
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")

err = Console(stderr=True)


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(code)


# ---- serving ---------------------------------------------------------------------------------------
@app.command()
def serve(
    model: str = typer.Option("builtin:tiny", "--model", "-m", help="builtin:NAME or a Hugging Face model directory"),
    layout: str = typer.Option(None, "--layout", "-l", help="e.g. attn_dp=2,attn_tp=1,moe_ep=2,moe_tp=1 (or JSON)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", help="0 picks a free port (the printed URL shows it)"),
    kv_cache_mb: int = typer.Option(None, "--kv-cache-mb", help="KV cache size per attention-DP group"),
    device: str = typer.Option(None, "--device", help="cuda, cuda:1, cpu (default: cuda when present)"),
) -> None:
    """Serve one model replica with an OpenAI-compatible API; prints its URL once listening."""
    from engine.config import ModelConfigError
    from engine.layout import LayoutError
    from engine.server import serve as _serve
    from engine.weights import ModelNotFoundError

    if kv_cache_mb is not None and kv_cache_mb < 1:
        _fail("--kv-cache-mb must be at least 1")
    try:
        _serve(model, layout, host, port, kv_cache_mb=kv_cache_mb, device=device)
    except (LayoutError, ModelNotFoundError, ModelConfigError) as e:
        _fail(str(e))


@app.command()
def up(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
) -> None:
    """Everything on one machine: for now one builtin:tiny replica (agent and gateway come later)."""
    # TODO(agent, gateway): start the node agent, let it launch the builtin:tiny replica on a free
    # port, and put the gateway on `port` in front of it; until then `up` is `serve`.
    serve(model="builtin:tiny", layout=None, host=host, port=port, kv_cache_mb=None, device=None)


# ---- models ----------------------------------------------------------------------------------------
@model_app.command("create")
def model_create(
    name: str = typer.Argument(..., help="builtin model name: tiny, bench, tiny-mixtral"),
    out: Path = typer.Option(..., "--out", "-o", help="directory to write (config.json, model.safetensors)"),
    shards: int = typer.Option(1, "--shards", help="number of safetensors files"),
) -> None:
    """Write a builtin model as a Hugging Face format directory."""
    from engine.builtin import create_builtin

    name = name.removeprefix("builtin:")
    try:
        create_builtin(name, out, shards=shards)
    except ValueError as e:
        _fail(str(e))
    Console().print(f"wrote builtin:{name} to {out}")


# ---- benchmarks ----------------------------------------------------------------------------------------
@bench_app.command("engine")
def bench_engine(
    model: str = typer.Option("builtin:bench", "--model", "-m"),
    new_tokens: int = typer.Option(32, "--new-tokens", help="tokens generated per sequence"),
    prompt_len: int = typer.Option(32, "--prompt-len"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Decode tokens/s of this engine vs Hugging Face transformers generate (batch 1 and 16)."""
    from engine import bench_engine as be

    try:
        res = be.run(model, new_tokens=new_tokens, prompt_len=prompt_len, log=err.print)
    except be.MissingDependency as e:
        _fail(str(e))
    be.print_table(res, Console())
    if as_json:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    app()
