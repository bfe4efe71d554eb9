"""The `relayout` command line (docs/cli.md).

One function per subcommand; the work lives in the modules they import lazily, so
`relayout --help` stays fast. Other subcommands (agent, gateway, checkpoint, restore,
migrate, drain, plan) are added below as `@app.command()`s or sub-apps. Sub-commands that
are not part of the product (`relayout bench ...`, in `relayout.bench.cli`) come in as
plugins: typer apps registered under the `relayout.commands` entry point group, which this
module loads by name and never imports.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from relayout.engine.command import fail as _fail
from relayout.engine.ranks.rank import rank_command
from relayout.migrate.gateway.cli import gateway_command
from relayout.migrate.replica.serve_cli import check_dtypes as _check_dtypes
from relayout.migrate.replica.serve_cli import serve_command
from relayout.storage.settings import settings
from rich.console import Console
from rich.markup import escape

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Checkpoint and live-migrate the in-flight sessions of MoE serving replicas.")
model_app = typer.Typer(no_args_is_help=True, help="Model files.")
app.add_typer(model_app, name="model")

err = Console(stderr=True)




@app.callback()
def _check_environment() -> None:
    """Every RELAYOUT_* variable is checked before any command runs (exit 2 naming a bad one)."""
    from relayout.storage.settings import SettingsError, check_settings

    try:
        check_settings()
    except SettingsError as e:
        _fail(str(e))


# ---- serving ---------------------------------------------------------------------------------------
# the replica's flags live with the replica (one definition for `relayout serve` and `python -m relayout.migrate.replica.serve`)
app.command(name="serve")(serve_command)


@app.command()
def demo(
    max_tokens: int = typer.Option(1200, "--max-tokens", min=200, max=4000, help="the story's length in tokens"),
) -> None:
    """A tour: start an agent, two replicas and a gateway, stream a story through the gateway, re-lay the
    session out to another layout mid-stream (marked, with its stall), then check the text equals an
    undisturbed run. Exit 0 when it does, 1 when it does not or a part failed, 130 on Ctrl-C."""
    import sys

    import httpx
    from relayout.agent.commands.demo import run_demo
    from relayout.migrate.procs import LaunchError

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        res = run_demo(write, lambda m: err.print(f"[dim]{escape(m)}[/dim]"), max_tokens=max_tokens)
    except KeyboardInterrupt:
        import os
        import signal

        # everything it started is stopped: leave now, so that nothing in the interpreter's shutdown (whose
        # SIGINT is the default again by then: a second Ctrl-C kills it) can turn exit 130 into a signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        err.print("\n[yellow]stopped[/yellow] (everything the demo started is stopped)")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    except (RuntimeError, httpx.HTTPError, LaunchError) as e:
        _fail(f"the demo could not run: {e}", 1)
    print()
    for e in res.errors:
        err.print(f"[red]{escape(e)}[/red]")
    if res.identical:
        err.print(f"[green]the streamed text ({res.reference_tokens} tokens) is exactly an undisturbed run's[/green] "
                  f"(moved after piece {res.moved_at}, stall {res.stall_ms} ms)")
    else:
        err.print("[red]the streamed text differs from an undisturbed run's[/red]")
    if res.errors or not res.identical:
        raise typer.Exit(1)


@app.command("vllm-config")
def vllm_config(
    exchange: Path = typer.Option(..., "--exchange", help="the exchange directory relayout and vLLM share (a "
                                                        "memory-backed volume in a pod); made if missing"),
) -> None:
    """Print the value of vLLM's --kv-transfer-config that loads relayout's connector on EXCHANGE, so a vLLM
    you start yourself can be attached (`relayout serve --engine vllm --attach URL --exchange DIR`). The
    exchange's secret is written into it (mode 0600), never onto a command line; an existing one is kept."""
    import json

    from relayout.engine.vllm.exchange import Exchange, ExchangeError
    from relayout.engine.vllm.server import kv_transfer_config

    try:
        ex = Exchange.ensure(exchange.resolve())
    except (OSError, ExchangeError) as e:
        _fail(f"--exchange {exchange}: {e}")
    print(json.dumps(kv_transfer_config(ex.dir)))


app.command(name="rank")(rank_command)  # defined with the rank (python -m relayout.engine.ranks.rank)


@app.command()
def up(
    host: str = typer.Option("127.0.0.1", "--host", help="address of the gateway, agent and replica"),
    port: int = typer.Option(8000, "--port", help="the gateway's port (0: a free one)"),
    agent_port: int = typer.Option(7070, "--agent-port", help="the agent's port (0: a free one)"),
    model: str = typer.Option("builtin:tiny", "--model", "-m", help="the replica's model"),
    layout: str = typer.Option(None, "--layout", "-l", help="the replica's layout"),
    data_dir: Path = typer.Option(Path.home() / ".relayout", "--data-dir", help="the agent's data dir"),
    dtype: str = typer.Option(None, "--dtype", help="the replica's float32, bfloat16 or float16 "
                                                   "(default: bfloat16 on CUDA, float32 on the CPU)"),
    kv_dtype: str = typer.Option(None, "--kv-dtype", help="the replica's KV cache: auto or fp8_e4m3"),
) -> None:
    """Everything on one machine: node agent, one replica launched through it, gateway in front."""
    from relayout.agent.commands.up import run_up

    _check_dtypes(dtype, kv_dtype)
    raise typer.Exit(run_up(host, port, agent_port, data_dir, model, layout, log=lambda m: err.print(f"up: {escape(m)}"),
                            dtype=dtype, kv_dtype=kv_dtype))


# ---- models ----------------------------------------------------------------------------------------
@model_app.command("create")
def model_create(
    name: str = typer.Argument(..., help="builtin model name: tiny, bench, tiny-mixtral"),
    out: Path = typer.Option(..., "--out", "-o", help="directory to write (config.json, model.safetensors)"),
    shards: int = typer.Option(1, "--shards", help="number of safetensors files"),
) -> None:
    """Write a builtin model as a Hugging Face format directory."""
    from relayout.engine.model.builtin import create_builtin

    name = name.removeprefix("builtin:")
    try:
        create_builtin(name, out, shards=shards)
    except ValueError as e:
        _fail(str(e))
    Console().print(escape(f"wrote builtin:{name} to {out}"))


# ---- gateway and live migration ------------------------------------------------------------------
app.command(name="gateway")(gateway_command)  # defined with the gateway (python -m relayout.migrate.gateway.app)


@app.command("migrate-replica")
def migrate_replica(
    source: str = typer.Argument(..., help="source replica URL"),
    target: str = typer.Argument(..., help="target replica URL (already launched, any layout)"),
    session: list[str] = typer.Option(None, "--session", help="session ids (default: all)"),
    mode: str = typer.Option("live", "--mode", help="live (pre-copy) or cold"),
) -> None:
    """Move sessions between two replicas directly (no agent), with a progress display."""
    from relayout.engine.web import env_token
    from relayout.migrate.protocol.live import MigrationError, MigrationPlan, migrate_live
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("migrating", total=None)
        try:
            res = migrate_live(source, target, session or None, token=env_token(), plan=MigrationPlan(mode=mode),
                               progress=lambda phase, n: bar.update(task, description=f"{phase} {n / 2**20:.1f} MiB"))
        except MigrationError as e:
            _fail(str(e), 1)
    print(json.dumps({"sessions": res.sessions, "not_moved": res.not_moved, "rounds": [r.__dict__ for r in res.rounds],
                      "bytes": res.bytes_total, "stall_ms": round(res.stall_ms, 2)}))



# ---- node agent ------------------------------------------------------------------------------------
def _token(token_file: Path | None) -> str | None:
    from relayout.engine.web import env_token

    if token_file is not None:
        try:
            return token_file.read_text().strip() or None
        except OSError as e:
            _fail(f"cannot read --token-file: {e}")
    return env_token()


@app.command()
def agent(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(7070, "--port", help="0 picks a free port (the printed URL shows it)"),
    data_dir: Path = typer.Option(Path.home() / ".relayout", "--data-dir", help="registry, logs, checkpoint store"),
    token_file: Path = typer.Option(None, "--token-file", help="bearer token file (else RELAYOUT_TOKEN)"),
) -> None:
    """Run the node agent: launches replicas and runs checkpoint/restore/migration operations."""
    from relayout.agent.agent import serve_agent

    serve_agent(host, port, data_dir, _token(token_file))


def _run_operation(agent_url: str, path: str, body: dict, token_file: Path | None, wait: bool = True) -> dict:
    import time

    import httpx
    from relayout.engine.web import bearer_headers, error_message
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    headers = bearer_headers(_token(token_file))
    base = agent_url.rstrip("/")
    try:
        resp = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=60)
    except httpx.HTTPError as e:
        _fail(f"cannot reach agent {base}: {e}", 1)
    if resp.status_code != 202:
        _fail(f"{resp.status_code}: {error_message(resp)[:300]}", 1)
    oid = resp.json()["operation_id"]
    if not wait:
        print(json.dumps({"operation_id": oid}))
        return {"id": oid}
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), console=err) as prog:
        task = prog.add_task(oid, total=None)
        while True:
            try:
                op = httpx.get(f"{base}/v1/operations/{oid}", headers=headers, timeout=30).json()
            except (httpx.HTTPError, ValueError) as e:
                _fail(f"lost the agent while polling {oid}: {e}", 1)
            prog.update(task, description=f"{op.get('kind')} {op.get('phase')}", completed=op.get("bytes_done") or 0,
                        total=op.get("bytes_total") or None)
            if op.get("state") in ("succeeded", "failed", "aborted"):
                break
            time.sleep(0.3)
    if op["state"] != "succeeded":
        if op.get("result"):
            print(json.dumps(op["result"], indent=1))
        _fail(f"{op.get('kind')} {op['state']}: {op.get('error')}", 1)
    print(json.dumps(op.get("result"), indent=1))
    return op


@app.command()
def checkpoint(
    replica: str = typer.Argument(..., help="replica id on the agent"),
    agent_url: str = typer.Option("http://127.0.0.1:7070", "--agent"),
    destination: str = typer.Option(None, "--destination", help="file:///abs/path or s3://bucket/prefix"),
    stop: bool = typer.Option(False, "--stop", help="end the sessions on the source once committed"),
    token_file: Path = typer.Option(None, "--token-file"),
) -> None:
    """Checkpoint a replica's sessions to a store; prints the checkpoint URI."""
    body: dict = {"stop": stop}
    if destination:
        body["destination"] = destination
    _run_operation(agent_url, f"/v1/replicas/{replica}/checkpoint", body, token_file)


@app.command()
def restore(
    checkpoint_uri: str = typer.Argument(..., help="<store URI>/<checkpoint id>"),
    replica: str = typer.Option(None, "--replica", help="existing replica id"),
    model: str = typer.Option(None, "--model", help="launch a new replica of this model"),
    layout: str = typer.Option(None, "--layout", help="layout of the new replica"),
    agent_url: str = typer.Option("http://127.0.0.1:7070", "--agent"),
    token_file: Path = typer.Option(None, "--token-file"),
) -> None:
    """Restore a checkpoint's sessions into a replica (an existing one, or a new one)."""
    if (replica is None) == (model is None):
        _fail("give either --replica ID or --model M [--layout L]")
    target = replica if replica is not None else {"model": model, "layout": layout}
    _run_operation(agent_url, "/v1/restore", {"checkpoint": checkpoint_uri, "replica": target}, token_file)


@app.command()
def migrate(
    replica: str = typer.Argument(..., help="replica id on the agent"),
    agent_url: str = typer.Option("http://127.0.0.1:7070", "--agent", help="the source replica's agent"),
    target_agent: str = typer.Option(None, "--target-agent", help="default: the same agent"),
    layout: str = typer.Option(None, "--layout", help="launch a new replica with this layout on the target"),
    target_replica: str = typer.Option(None, "--target-replica", help="an existing replica id on the target"),
    session: list[str] = typer.Option(None, "--session", help="session ids (default: all)"),
    mode: str = typer.Option("live", "--mode", help="live (pre-copy) or cold"),
    token_file: Path = typer.Option(None, "--token-file"),
) -> None:
    """Move a replica's sessions to another replica (new, with --layout; or existing) through the agent."""
    if (layout is None) == (target_replica is None):
        _fail("give either --layout L (a new replica) or --target-replica ID")
    if mode not in ("live", "cold"):
        _fail("--mode is live or cold")
    target: dict = {"agent": (target_agent or agent_url).rstrip("/")}
    target.update({"layout": layout} if layout is not None else {"replica": target_replica})
    body: dict = {"target": target, "mode": mode}
    if session:
        body["sessions"] = session
    _run_operation(agent_url, f"/v1/replicas/{replica}/migrate", body, token_file)


@app.command()
def protect(
    replica: str = typer.Argument(..., help="replica id on the agent"),
    agent_url: str = typer.Option("http://127.0.0.1:7070", "--agent", help="the replica's agent"),
    standby_agent: str = typer.Option(None, "--standby-agent", help="default: the same agent"),
    standby_replica: str = typer.Option(None, "--standby-replica", help="an existing replica id there"),
    layout: str = typer.Option(None, "--layout", help="launch a new standby replica with this layout"),
    every_tokens: int = typer.Option(16, "--every-tokens", help="sync a session every N new tokens"),
    every_ms: int = typer.Option(200, "--every-ms", help="... or every T ms, whichever first"),
    lease_s: float = typer.Option(None, "--lease-s", show_default=False,
                                  help="the source stops serving after this long unrenewed [default: 0.6, the replica's]"),
    stop: bool = typer.Option(False, "--stop", help="stop protecting (the standby frees its copies)"),
    show: bool = typer.Option(False, "--show", help="print the protection and each session's replication lag"),
    token_file: Path = typer.Option(None, "--token-file"),
) -> None:
    """Replicate a replica's sessions continuously to a standby replica, promoted there if it dies."""
    import httpx
    from relayout.engine.web import bearer_headers, error_message

    url = f"{agent_url.rstrip('/')}/v1/replicas/{replica}/protect"
    headers = bearer_headers(_token(token_file))
    try:
        if stop or show:
            resp = httpx.request("DELETE" if stop else "GET", url, headers=headers, timeout=60)
        else:
            if (layout is None) == (standby_replica is None):
                _fail("give either --standby-replica ID or --layout L (a new standby)")
            sb: dict = {"agent": (standby_agent or agent_url).rstrip("/")}
            sb.update({"layout": layout} if layout is not None else {"replica": standby_replica})
            resp = httpx.post(url, headers=headers, timeout=600, json={
                "standby": sb, "every_tokens": every_tokens, "every_ms": every_ms,
                **({"lease_s": lease_s} if lease_s is not None else {})})
    except httpx.HTTPError as e:
        _fail(f"cannot reach agent {agent_url}: {e}", 1)
    if resp.status_code != 200:
        _fail(f"{resp.status_code}: {error_message(resp)[:300]}", 1)
    print(json.dumps(resp.json(), indent=1))


def _drain_target(agent_url: str, headers: dict) -> str:
    """A drain target from RELAYOUT_DRAIN_TARGET or RELAYOUT_AGENTS (comma/space separated; a name that resolves to
    several addresses, like a headless Service, counts as each of them): the first healthy agent that is neither
    this one nor draining."""
    import re
    import socket
    from urllib.parse import urlsplit

    import httpx

    try:
        me = httpx.get(f"{agent_url}/healthz", timeout=10).json().get("agent_id")
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        _fail(f"cannot reach agent {agent_url}: {e}", 1)
    st = settings()
    raw = st.drain_target or st.agents or ""
    for url in [u for u in re.split(r"[,\s]+", raw) if u]:
        parts = urlsplit(url.rstrip("/"))
        try:
            addrs = sorted({a[4][0] for a in socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_STREAM)})
        except (socket.gaierror, UnicodeError, TypeError):
            continue
        for a in addrs:
            cand = f"{parts.scheme}://{'[' + a + ']' if ':' in a else a}:{parts.port or 80}"
            try:
                h = httpx.get(f"{cand}/healthz", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            if h.get("status") == "ok" and h.get("agent_id") != me and not h.get("draining"):
                return cand
    _fail("no drain target: give --target-agent URL (or set RELAYOUT_DRAIN_TARGET / RELAYOUT_AGENTS)")
    return ""


@app.command()
def drain(
    agent_url: str = typer.Option("http://127.0.0.1:7070", "--agent", help="the agent (node) to drain"),
    target_agent: str = typer.Option(None, "--target-agent",
                                     help="agent to move the sessions to (default: RELAYOUT_DRAIN_TARGET or "
                                          "another agent of RELAYOUT_AGENTS)"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the operation to its end (default)"),
    token_file: Path = typer.Option(None, "--token-file"),
    layout: list[str] = typer.Option(None, "--layout", help="REPLICA_ID=LAYOUT: launch that replica's target with "
                                                            "this (planned) layout; repeatable"),
) -> None:
    """Move every session of every replica on a node to new replicas on another agent (live), then the node
    refuses new replicas and sessions until `POST /v1/undrain`. Prints per-replica results."""
    from relayout.engine.web import bearer_headers

    base = agent_url.rstrip("/")
    body: dict = {}
    for item in layout or []:
        rid, sep, lay = item.partition("=")
        if not sep or not rid or not lay:
            _fail(f"--layout wants REPLICA_ID=LAYOUT, got {item!r}")
        body.setdefault("layouts", {})[rid] = lay
    target = target_agent or _drain_target(base, bearer_headers(_token(token_file)))
    _run_operation(base, "/v1/drain", {"target_agent": target.rstrip("/"), **body}, token_file, wait=wait)


@app.command()
def status(
    agent_url: list[str] = typer.Option(None, "--agent", help="an agent to ask; repeatable (default "
                                                              "http://127.0.0.1:7070)"),
    as_json: bool = typer.Option(False, "--json", help="print the gathered status as JSON (for scripts)"),
    wide: bool = typer.Option(False, "--wide", help="full ids, full layouts and the replicas' URLs"),
    token_file: Path = typer.Option(None, "--token-file"),
) -> None:
    """Nodes, their replicas (layout, sessions, KV used, expert balance), the operations running now with
    their progress, and which nodes drain. Exit code 1 when an agent cannot be reached."""
    from relayout.agent.commands.status import gather, render

    st = gather(agent_url or ["http://127.0.0.1:7070"], _token(token_file))
    if as_json:
        print(json.dumps(st, indent=1))
    else:
        con = Console()
        con.print(render(st, width=con.width, wide=wide))
    if not all(n["reachable"] for n in st["nodes"]):
        raise typer.Exit(1)


# ---- layout planning and the re-layout controller -------------------------------------------------
@app.command()
def plan(
    input_json: str = typer.Argument("-", metavar="[INPUT.json|-]",
                                     help="{topology, load, needs, ...} as JSON; - reads stdin"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as one JSON object on the last line"),
    fmt: str = typer.Option("relayout", "--format", help="relayout (the plan, printed) or sglang: also write "
                                                        "the placement as SGLang's --init-expert-location file"),
    out: Path = typer.Option(None, "--out", help="with --format sglang: the expert location JSON file to write"),
    locality_weight: float = typer.Option(
        None, "--locality-weight", min=0.0, max=1.0,
        help="0..1: how the planner trades GPU balance for fewer cross-node token copies when spare "
             "slots cannot buy both (0 = best balance, 1 = fewest cross-node copies; default 0.1, or "
             "the input's locality_weight)"),
) -> None:
    """Expert load + fleet topology -> layout, device set and the reason (or why nothing is placeable).

    Exits 2 when the input breaks a rule (the message names the field), 1 when no device set fits."""
    import sys

    from relayout.migrate.placement.plan_cli import format_plan_table, plan_main

    try:
        text = sys.stdin.read() if input_json == "-" else Path(input_json).read_text()
        inp = json.loads(text)
    except OSError as e:
        _fail(f"cannot read {input_json}: {e}")
    except json.JSONDecodeError as e:
        _fail(f"{input_json}: not valid JSON: {e}")
    if not isinstance(inp, dict):
        _fail("the plan input must be a JSON object {topology, load, needs, ...}")
    if fmt not in ("relayout", "sglang"):
        _fail(f"--format must be relayout or sglang, not {fmt!r}", 2)
    if fmt == "sglang" and out is None:
        _fail("--format sglang needs --out FILE (the expert location JSON SGLang reads)", 2)
    if locality_weight is not None:
        inp["locality_weight"] = locality_weight
    ref, ref_name = _plan_reference()
    res = plan_main(inp, reference=ref, reference_name=ref_name)
    Console(stderr=as_json).print(format_plan_table(res))
    if as_json and "error" in res:
        print(json.dumps(res), flush=True)
    if res.get("invalid_input"):
        _fail(res["error"], 2)
    if "error" in res:
        raise typer.Exit(1)
    if fmt == "sglang":
        from relayout.migrate.placement.plan_cli import sglang_expert_location

        doc = sglang_expert_location(res, res.get("num_layers"), res.get("moe_layers"))
        try:
            out.write_text(json.dumps(doc))
        except OSError as e:
            _fail(f"--out {out}: {e}")
        Console(stderr=True).print(f"wrote {out}: SGLang expert locations for {len(doc['physical_to_logical_map'])} "
                                   f"layers; start SGLang with --init-expert-location {out} --ep-size "
                                   f"{len(res['devices'])} --ep-num-redundant-experts {res['redundant_slots']}")
    if as_json:
        print(json.dumps(res), flush=True)


def _plan_reference():
    """The yardstick `relayout plan` compares its placement with: the first entry point of the
    `relayout.plan_references` group (DeepSeek's EPLB from relayout.bench), loaded by name so the
    product never imports the benchmarks; none installed, no comparison."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="relayout.plan_references"):
        try:
            return ep.load(), ep.name
        except (ImportError, AttributeError) as e:
            err.print(f"[yellow]warning:[/yellow] plan reference {ep.name!r} not loaded: {escape(str(e))}")
    return None, "reference"


@app.command()
def controller(
    replica: str = typer.Option(None, "--replica", help="URL of the one replica to watch (launches its successors here)"),
    agents: str = typer.Option(None, "--agents", help="comma-separated agent URLs: watch every replica of every "
                                                      "agent (default without --replica: RELAYOUT_AGENTS)"),
    agent: list[str] = typer.Option(None, "--agent", help="an agent URL (repeatable; added to --agents)"),
    topology: Path = typer.Option(None, "--topology", help="fleet topology (YAML or JSON), checked and reported"),
    interval: float = typer.Option(10.0, "--interval", help="seconds between polls"),
    dry_run: bool = typer.Option(False, "--dry-run", help="log the decisions, never relayout"),
    margin: float = typer.Option(1.5, "--margin", help="relayout when gain > cost x margin"),
    consecutive: int = typer.Option(3, "--consecutive", help="... for this many polls in a row"),
    cooldown: float = typer.Option(600.0, "--cooldown", help="seconds between relayouts"),
    horizon: float = typer.Option(600.0, "--horizon", help="seconds of traffic the gain is counted over"),
) -> None:
    """Relayout replicas when a better expert placement pays for the move (one JSON line per poll and replica).

    --replica URL watches one replica; --agents/--agent watch every replica of every agent, and the
    replica's own agent launches the new layout and migrates onto it."""
    import signal
    import threading

    from relayout.engine.tracing import setup_tracing
    from relayout.migrate.placement.policy import PolicyConfig, RelayoutPolicy

    agent_urls = [u for u in ([agents] if agents else []) + list(agent or []) if u.strip()]
    if replica and agent_urls:
        _fail("give either --replica URL (one replica) or --agents/--agent URL (every replica of the agents), not both")
    if not replica and not agent_urls and (settings().agents or "").strip():
        agent_urls = [settings().agents or ""]
    if not replica and not agent_urls:
        _fail("give --replica URL (one replica) or --agents URL[,URL...] (or RELAYOUT_AGENTS) for the fleet")
    if interval <= 0 or consecutive < 1 or margin <= 0:
        _fail("--interval and --margin must be positive, --consecutive at least 1")
    if topology is not None:
        from relayout.migrate.placement.topology import Topology, TopologyError

        try:
            topo = Topology.load(topology)
        except TopologyError as e:
            _fail(f"--topology: {e}")
        # the policy keeps the attention split and world size, so the topology changes no decision yet
        err.print(f"topology {topology}: {len(topo.nodes)} nodes, {len(topo.devices())} devices "
                  f"({sum(d.free for d in topo.devices())} free); checked, not used by the policy")
    setup_tracing("relayout-controller")  # each re-layout is a trace when OTEL_* configure an exporter
    cfg = PolicyConfig(margin=margin, consecutive=consecutive, cooldown_s=cooldown, horizon_s=horizon)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    line = lambda s: print(s, flush=True)  # noqa: E731
    if replica:
        from relayout.migrate.placement.controller import Controller, SubprocessLauncher

        ctl = Controller(replica, SubprocessLauncher(), RelayoutPolicy(cfg), interval, dry_run=dry_run, log=line)
        watching = replica
    else:
        from relayout.agent.commands.fleet import FleetController

        ctl = FleetController(agent_urls, cfg, interval, dry_run=dry_run, log=line)
        watching = "the replicas of " + ", ".join(ctl.agents)
    err.print(f"relayout controller watching {watching} every {interval:g}s" + (" (dry run)" if dry_run else ""))
    try:
        ctl.run_forever(stop)
    except KeyboardInterrupt:
        pass
    err.print(f"controller stopped; replica now at {ctl.replica_url}" if replica else "controller stopped")


# ---- plugin sub-commands -------------------------------------------------------------------------
PLUGIN_GROUP = "relayout.commands"


def add_plugin_commands(root: typer.Typer) -> list[str]:
    """Add every typer app registered under the `relayout.commands` entry point group as a
    sub-command named after its entry point; returns the names added. A plugin that fails to
    import is reported on stderr and left out, so a broken plugin cannot break the product."""
    from importlib.metadata import entry_points

    added: list[str] = []
    for ep in entry_points(group=PLUGIN_GROUP):
        if ep.name in added:
            continue  # the same distribution seen twice on sys.path (e.g. installed and editable)
        try:
            root.add_typer(ep.load(), name=ep.name)
        except (ImportError, AttributeError) as e:
            err.print(f"[yellow]warning:[/yellow] plugin command {ep.name!r} ({ep.value}) not loaded: {escape(str(e))}",
                      soft_wrap=True)
            continue
        added.append(ep.name)
    return added


add_plugin_commands(app)


if __name__ == "__main__":
    app()
