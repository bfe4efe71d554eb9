"""`relayout status` (docs/cli.md): what runs where and what moves, across node agents — per node its
draining state, per replica its layout, sessions, KV use and expert balance, and the operations
running now with their progress. `gather()` asks the agents; `render()` draws it: a heading per node and
a table under it that fits the terminal (short ids, compact layouts; `--wide` for everything)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from relayout.engine.web import bearer_headers, tls_context
from rich.console import Group
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


def _as_dict(lay: Any) -> Any:
    """A layout as a record may hold it: an object, its JSON, or `attn_dp=2,moe_ep=2` (else as it is)."""
    if isinstance(lay, str):
        text = lay.strip()
        try:
            if text.startswith("{"):
                return json.loads(text)
            if "=" in text:
                return {k.strip(): int(v) for k, v in (p.split("=", 1) for p in text.split(",") if p.strip())}
        except (ValueError, TypeError):
            return lay
    return lay


def compact_layout(lay: Any) -> str:
    """`dp1 tp2 ep1` (and `mtp2`, `+placement`, `overlap` when set): the layout in a few characters."""
    lay = _as_dict(lay)
    if not isinstance(lay, dict):
        return str(lay or "-")
    text = f"dp{lay.get('attn_dp', 1)} tp{lay.get('attn_tp', 1)} ep{lay.get('moe_ep', 1)}"
    if lay.get("moe_tp", 1) != 1:
        text += f" mtp{lay['moe_tp']}"
    return text + (" +placement" if lay.get("placement") else "") + (" overlap" if lay.get("overlap") else "")


def _full_layout(lay: Any) -> str:
    lay = _as_dict(lay)
    if not isinstance(lay, dict):
        return str(lay or "-")
    keys = ("attn_dp", "attn_tp", "moe_ep", "moe_tp")
    text = ",".join(f"{k}={lay[k]}" for k in keys if k in lay)
    return text + (" +placement" if lay.get("placement") else "") + (" overlap" if lay.get("overlap") else "")


def short_ids(ids: list[str], keep: int = 4) -> dict[str, str]:
    """Each id cut to its prefix and `keep` characters after it (`r-3cce1a2b` -> `r-3cce`), longer where
    two would read the same."""
    out: dict[str, str] = {}
    for i in ids:
        head = i.split("-", 1)[0] + "-" if "-" in i else ""
        n = keep
        while True:
            cand = i[: len(head) + n]
            if cand == i or sum(1 for j in ids if j.startswith(cand)) <= 1:
                out[i] = cand
                break
            n += 1
    return out


def _progress(op: dict, width: int) -> Any:
    """A bar and `done/total` (bytes, or sessions for a drain) in `width` columns."""
    done, total = op["done"], op["total"]
    fmt = (lambda v: f"{v:g}") if op.get("kind") == "drain" else _bytes
    if not total:
        return Text(fmt(done) if done else "")
    label = f" {fmt(done)}/{fmt(total)}"
    w = max(4, width - len(label))
    k = round(w * min(1.0, done / total))
    # drawn as text, not rich's ProgressBar: the part still to go stays visible without colours (a pipe, a log)
    return Text.assemble(("━" * k, "green"), ("─" * (w - k), "dim"), label)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _table(cols: list[str]) -> Table:
    t = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), expand=False, show_edge=False)
    for col in cols:
        t.add_column(col, no_wrap=True, header_style="bold dim")
    return t


def render(status: dict[str, Any], width: int = 80, wide: bool = False) -> Group:
    """Per node a heading (its URL and state), a table of its replicas and one of the operations running
    on it. Fits `width` columns without cutting a cell: short ids, compact layouts and a progress bar
    sized to what is left; `wide` shows full ids, layouts and the replicas' URLs."""
    parts: list[Any] = [Text("relayout status", style="bold")]
    for node in status["nodes"]:
        state = ("[red]unreachable[/red]" if not node["reachable"] else
                 "[yellow]draining[/yellow]" if node["draining"] else "[green]serving[/green]")
        head = f"[bold]{node['agent']}[/bold]  {state}" + (f"  {node['error']}" if node.get("error") else "")
        parts.append(Text.from_markup(head))
        reps, ops = node["replicas"], node["operations"]
        names = short_ids([r["id"] for r in reps] + [op["id"] for op in ops])
        if wide:
            names = {k: k for k in names}
        lay = _full_layout if wide else compact_layout
        if reps:
            t = _table(["replica", "status", "layout", "sessions", "KV used", "balance"] + (["url"] if wide else []))
            for r in reps:
                kv = f"{r['kv_blocks_used']}/{r['kv_blocks_total']}" if r.get("kv_blocks_total") else "-"
                bal = f"{r['expert_balance']:.2f}" if r.get("expert_balance") is not None else "-"
                t.add_row(names[r["id"]], r["status"] or "", lay(r["layout"]), str(r["sessions"]), kv, bal,
                          *([r.get("url") or ""] if wide else []))
                if r.get("error"):
                    t.add_row("", f"[red]{r['error']}[/red]", "", "", "", "")
            parts.append(t)
        if ops:
            rows = []
            for op in ops:
                target = f" {names.get(op['replica'], op['replica'])}" if op.get("replica") else ""
                rows.append((f"{op['kind']} {names[op['id']]}{target}", op["state"], op.get("phase") or "", op))
            used = max(len(a) + len(b) + len(c) for a, b, c, _ in rows) + 6
            t = _table(["operation", "state", "phase", "progress"])
            for what, st, phase, op in rows:
                t.add_row(f"[cyan]{what}[/cyan]", st, phase, _progress(op, min(48, max(16, width - used - 1))))
                for e in op.get("replicas", []):
                    start = e.get("sessions_at_start")
                    t.add_row(f"  {names.get(e['replica'], e['replica'])} -> {e.get('target_replica') or '?'}",
                              e.get("state") or "", f"{e['sessions_moved']}/{start if start is not None else '?'} moved",
                              "")
            parts.append(t)
    return Group(*parts)
