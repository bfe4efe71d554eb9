"""`relayout status` (docs/cli.md): what runs where and what moves, across node agents — per node its
draining state, per replica its layout, sessions, KV use and expert balance, and the operations
running now with their progress. `gather()` asks the agents; `render()` draws one rich table."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from relayout.engine.web import bearer_headers, tls_context
from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

LIVE = ("pending", "running")


async def _node(c: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, Any]:
    node: dict[str, Any] = {"agent": url, "reachable": False, "draining": None, "replicas": [], "operations": []}
    try:
        health = (await c.get(f"{url}/healthz")).json()
        node.update(reachable=True, agent_id=health.get("agent_id"), draining=bool(health.get("draining")))
        listing = await c.get(f"{url}/v1/replicas", headers=headers)
        if listing.status_code != 200:
            node["error"] = f"/v1/replicas answered {listing.status_code}"
            return node
        ids = [r["id"] for r in listing.json().get("replicas", [])]
        details = await asyncio.gather(*(c.get(f"{url}/v1/replicas/{rid}", headers=headers) for rid in ids))
        node["replicas"] = [_replica(d.json()) for d in details if d.status_code == 200]
        ops = (await c.get(f"{url}/v1/operations", headers=headers)).json().get("operations", [])
        node["operations"] = [_operation(op) for op in ops if op.get("state") in LIVE]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        node["error"] = f"{type(e).__name__}: {e}"
    return node


def _replica(r: dict) -> dict[str, Any]:
    return {"id": r.get("id"), "status": r.get("status"), "model": r.get("model"), "url": r.get("url"),
            "layout": r.get("layout"), "sessions": len(r.get("sessions") or []),
            "kv_blocks_used": r.get("kv_blocks_used"), "kv_blocks_total": r.get("num_blocks"),
            "expert_balance": r.get("expert_balance"), "error": r.get("replica_error")}


def _operation(op: dict) -> dict[str, Any]:
    out = {k: op.get(k) for k in ("id", "kind", "replica", "state", "phase", "bytes_done", "bytes_total")}
    done, total = progress_of(op)
    out.update(done=done, total=total)
    if op.get("kind") == "drain":
        out["replicas"] = [{k: e.get(k) for k in ("replica", "state", "target_replica", "sessions_at_start")}
                           | {"sessions_moved": len(e.get("sessions_moved") or [])}
                           for e in (op.get("result") or {}).get("replicas", [])]
    return out


def progress_of(op: dict) -> tuple[float, float | None]:
    """(done, total) of an operation: a drain counts sessions settled (moved, finished, given up) out of
    those live when it began; the others count bytes (total None while unknown)."""
    if op.get("kind") == "drain":
        entries = (op.get("result") or {}).get("replicas", [])
        total = sum(e.get("sessions_at_start") or 0 for e in entries)
        done = sum(len(e.get("sessions_moved") or []) + len(e.get("sessions_finished_here") or [])
                   + len(e.get("sessions_not_moved") or []) for e in entries)
        if not total:  # nothing listed yet: count replicas instead
            return float(sum(e.get("state") in ("drained", "failed", "skipped") for e in entries)), float(len(entries) or 1)
        return float(min(done, total)), float(total)
    return float(op.get("bytes_done") or 0), (float(op["bytes_total"]) if op.get("bytes_total") else None)


async def gather_async(agents: list[str], token: str | None, timeout: float = 10.0) -> dict[str, Any]:
    headers = bearer_headers(token)
    async with httpx.AsyncClient(verify=tls_context(), timeout=timeout) as c:
        nodes = await asyncio.gather(*(_node(c, a.rstrip("/"), headers) for a in agents))
    return {"nodes": list(nodes)}


def gather(agents: list[str], token: str | None, timeout: float = 10.0) -> dict[str, Any]:
    """The status of every agent in `agents` (an unreachable one is listed with its error)."""
    return asyncio.run(gather_async(agents, token, timeout))


def _layout(lay: Any) -> str:
    if not isinstance(lay, dict):
        return str(lay or "-")
    keys = ("attn_dp", "attn_tp", "moe_ep", "moe_tp")
    text = ",".join(f"{k}={lay[k]}" for k in keys if k in lay)
    return text + (" +placement" if lay.get("placement") else "") + (" overlap" if lay.get("overlap") else "")


def _bar(done: float, total: float | None) -> Any:
    if not total:
        return Text(f"{_bytes(done)}" if done else "")
    return Group(ProgressBar(total=total, completed=done, width=24), Text(f"{done:g}/{total:g}"))


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def render(status: dict[str, Any]) -> Table:
    """One table: a row per replica, then a row per running operation, grouped by node."""
    t = Table(title="relayout status", show_lines=False, expand=False)
    for col in ("node", "replica / operation", "status", "layout / phase", "sessions", "KV used", "expert balance",
                "progress"):
        t.add_column(col)
    for node in status["nodes"]:
        state = ("[red]unreachable[/red]" if not node["reachable"] else
                 "[yellow]draining[/yellow]" if node["draining"] else "[green]serving[/green]")
        t.add_row(f"[bold]{node['agent']}[/bold]", "", state, node.get("error") or "", "", "", "", "")
        for r in node["replicas"]:
            kv = (f"{r['kv_blocks_used']}/{r['kv_blocks_total']}" if r.get("kv_blocks_total") else "-")
            bal = f"{r['expert_balance']:.2f}" if r.get("expert_balance") is not None else "-"
            t.add_row("", r["id"], r["status"] or "", _layout(r["layout"]), str(r["sessions"]), kv, bal,
                      r.get("error") or "")
        for op in node["operations"]:
            what = f"{op['kind']} {op['id']}" + (f" ({op['replica']})" if op.get("replica") else "")
            t.add_row("", f"[cyan]{what}[/cyan]", op["state"], op.get("phase") or "", "", "", "",
                      _bar(op["done"], op["total"]))
            for e in op.get("replicas", []):
                t.add_row("", f"  {e['replica']} -> {e.get('target_replica') or '…'}", e.get("state") or "", "",
                          f"{e['sessions_moved']}/{e.get('sessions_at_start') if e.get('sessions_at_start') is not None else '?'}",
                          "", "", "")
        t.add_section()
    return t
