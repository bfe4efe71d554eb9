"""Drain (docs/agent-api.md): move every session of every replica on this node to another node before
maintenance; every session live when the drain began ends up named in its result."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import APIRouter, Depends
from relayout.agent.node.registry import Operation
from relayout.agent.node.schema import OP_TIMEOUT, DrainBody, validate_layout
from relayout.agent.node.state import Agent, agent_of
from relayout.engine import tracing, web
from relayout.engine.web import HTTPError, tls_context

if TYPE_CHECKING:
    from relayout.migrate.protocol.live import MigrationResult
    from relayout.migrate.protocol.relocate import Relocation

DRAIN_PASSES = 8  # re-list and retry: sessions that finish or arrive while a replica is moved


async def check_drain_targets(ag: Agent, target: str, into: dict[str, str],
                              layouts: dict[str, str | None]) -> dict[str, str]:
    """Each `target_replicas` entry: a replica here -> a running replica on `target` of the same model
    and engine; 400 naming the entry otherwise (before the node starts draining)."""
    for rid, trid in into.items():
        if not web.ID_RE.fullmatch(rid) or rid not in ag.reg.replicas:
            raise HTTPError(400, f"target_replicas: no replica {rid!r} on this node")
        if not web.ID_RE.fullmatch(trid):
            raise HTTPError(400, f"target_replicas[{rid}]: {trid!r} is not a replica id")
        if rid in layouts:
            raise HTTPError(400, f"target_replicas[{rid}]: the replica has a planned layout too: name one of the two")
        async with ag.client(30.0) as c:
            resp = await c.get(f"{target}/v1/replicas/{trid}", headers=ag.headers())
        if resp.status_code != 200:
            raise HTTPError(400, f"target_replicas[{rid}]: the target agent has no replica {trid} "
                                 f"({resp.status_code}: {web.error_message(resp)[:200]})")
        have, want = resp.json(), ag.reg.replicas[rid]
        if have.get("status") != "running":
            raise HTTPError(400, f"target_replicas[{rid}]: replica {trid} is {have.get('status')}, not running")
        for key, default in (("model", None), ("engine", "builtin")):
            if have.get(key, default) != getattr(want, key):
                raise HTTPError(400, f"target_replicas[{rid}]: replica {trid} runs {key} {have.get(key, default)!r}, "
                                     f"this one {getattr(want, key)!r}")
    return dict(into)


@dataclass
class DrainEntry:
    """One replica's part of a drain's result (shown while it runs)."""

    replica: str
    state: str = "pending"  # pending | launching | launched | migrating | drained | failed | skipped
    target_replica: str | None = None
    target_url: str | None = None
    sessions_moved: list[str] = field(default_factory=list)
    sessions_finished_here: list[str] = field(default_factory=list)
    sessions_not_moved: list[dict[str, str]] = field(default_factory=list)  # {"id", "error"}
    error: str | None = None
    bytes_done: int = 0
    launch_s: float | None = None
    move_s: float | None = None
    sessions_at_start: int | None = None  # what progress counts against
    transfers: list[str] = field(default_factory=list)  # each migration's id, as both replicas know it

    def failed(self, why: str) -> None:
        self.state, self.error = "failed", why


async def drain_node(ag: Agent, op: Operation, target: str, layouts: dict[str, str | None] | None = None,
                     into: dict[str, str] | None = None) -> dict:
    """Move every session of every replica on this node to new replicas of the same model on
    `target`, each with its own layout unless `layouts` plans another for it, or into the running
    replica `into` names for it. Progress per replica is in op.result while it runs; a session
    that cannot be moved is listed in `sessions_not_moved` (the op then fails), never dropped silently."""
    return await NodeDrain(ag, op, target, layouts or {}, into or {}).run()


class NodeDrain:
    """One drain of this node, stage by stage: list what is live, then per replica (all at once) launch
    its target, move its sessions (migrate.protocol.relocate's passes), and account for every session."""

    def __init__(self, ag: Agent, op: Operation, target: str, layouts: dict[str, str | None], into: dict[str, str]):
        self.ag, self.op, self.target, self.layouts, self.into = ag, op, target, layouts, into
        self.res: dict[str, Any] = {"target_agent": target, "replicas": [], "sessions_moved": 0,
                                    "sessions_not_moved": []}
        op.result = self.res
        self.rids = [rid for rid in list(ag.reg.replicas) if ag.refresh(rid).status == "running"]
        self.entries = {rid: DrainEntry(rid) for rid in self.rids}
        # what was live when the drain began: every one of these ends up named in the result
        self.live_at_start: dict[str, set[str]] = {rid: set() for rid in self.rids}
        self.res["replicas"] = list(self.entries.values())
        for rid, r in ag.reg.replicas.items():
            if rid not in self.entries and r.status in ("dead", "starting"):
                self.res["replicas"].append(DrainEntry(rid, state="skipped", error=f"replica is {r.status}"))

    async def run(self) -> dict:
        ag, entries, res = self.ag, self.entries, self.res
        try:
            for rid in self.rids:
                try:
                    self.live_at_start[rid] = set(await self.sessions_of(ag.reg.replicas[rid].url))
                    entries[rid].sessions_at_start = len(self.live_at_start[rid])  # what progress counts against
                except (httpx.HTTPError, HTTPError, ValueError):
                    pass  # move() lists again; an unreachable replica fails there with the reason
            self.op.phase = "launching target replicas"
            await asyncio.gather(*(self.drain_replica(rid) for rid in self.rids))
            # replicas that failed before moving anything: their live sessions are reported too
            for rid in self.rids:
                e = entries[rid]
                if e.state == "failed" and not e.sessions_not_moved:
                    try:
                        left = await self.sessions_of(ag.reg.replicas[rid].url)
                    except (httpx.HTTPError, HTTPError, ValueError):
                        left = []
                    e.sessions_not_moved = [{"id": s, "error": e.error or "failed"} for s in left]
        finally:
            res["sessions_moved"] = sum(len(e.sessions_moved) for e in entries.values())
            res["sessions_not_moved"] = [s for e in entries.values() for s in e.sessions_not_moved]
            res["sessions"] = [s for e in entries.values() for s in e.sessions_moved]
            ag.reg.save()
        bad = [e for e in entries.values() if e.state == "failed"]
        if bad:
            raise HTTPError(502, f"drain incomplete: {len(res['sessions_not_moved'])} session(s) not moved, "
                                  f"replica(s) {', '.join(e.replica for e in bad)} failed; see result")
        self.op.phase = "drained"
        return res

    # ---- asking the replicas ----------------------------------------------------------------------
    async def sessions_of(self, url: str) -> list[str]:
        async with self.ag.client(30.0) as c:
            resp = await c.get(f"{url}/v1/replica", headers=self.ag.headers())
        if resp.status_code != 200:  # an error's body lists no sessions: that is not "none left"
            raise HTTPError(502, f"replica {url} answered {resp.status_code}: {web.error_message(resp)[:300]}")
        return [s["id"] for s in resp.json()["sessions"]]

    async def session_state(self, url: str, sid: str) -> str:
        try:
            async with self.ag.client(10.0) as c:
                return (await c.get(f"{url}/v1/sessions/{sid}", headers=self.ag.headers())).json().get("state", "unknown")
        except (httpx.HTTPError, ValueError):
            return "unknown"

    async def wait_not_busy(self, rid: str) -> None:
        end = time.monotonic() + 300
        while rid in self.ag.busy and time.monotonic() < end:
            await asyncio.sleep(0.2)
        if rid in self.ag.busy:
            raise HTTPError(409, f"replica {rid} stayed busy with operation {self.ag.busy[rid]}")

    # ---- one replica ------------------------------------------------------------------------------
    async def drain_replica(self, rid: str) -> None:
        # each replica moves as soon as its own target is up: sessions keep decoding on the source
        # meanwhile, and a later replica's sessions do not wait behind an earlier one's move
        with tracing.span("drain-replica", replica=rid) as sp:  # its launch and migrations below it
            await self.drain_one(rid)
            e = self.entries[rid]
            sp.set_attributes(tracing.attributes({"state": e.state, "bytes": e.bytes_done,
                                                  "sessions_moved": len(e.sessions_moved)}))

    async def drain_one(self, rid: str) -> None:
        e = self.entries[rid]
        t0 = time.monotonic()
        try:
            with tracing.span("launching", replica=rid):
                await self.launch_target(rid)
            e.launch_s = round(time.monotonic() - t0, 2)
            await self.wait_not_busy(rid)
        except HTTPError as err:
            e.failed(err.message)
            return
        except (httpx.HTTPError, ValueError, KeyError) as err:
            e.failed(f"{type(err).__name__}: {err}")
            return
        self.ag.busy[rid] = self.op.id
        t0 = time.monotonic()
        try:
            await self.move(rid)
        except HTTPError as err:
            e.failed(err.message)
        except (httpx.HTTPError, ValueError, KeyError) as err:
            e.failed(f"{type(err).__name__}: {err}")
        finally:
            self.ag.busy.pop(rid, None)
            e.move_s = round(time.monotonic() - t0, 2)

    async def launch_target(self, rid: str) -> None:
        ag, target = self.ag, self.target
        e, r = self.entries[rid], ag.reg.replicas[rid]
        if rid in self.into:  # started ahead on the target: checked by check_drain_targets
            async with ag.client(30.0) as c:
                resp = await c.get(f"{target}/v1/replicas/{self.into[rid]}", headers=ag.headers())
            if resp.status_code != 200 or resp.json().get("status") != "running":
                raise HTTPError(502, f"target replica {self.into[rid]} is gone ({resp.status_code})")
            e.target_replica, e.target_url, e.state = self.into[rid], resp.json()["url"], "launched"
            return
        e.state = "launching"
        async with ag.client(OP_TIMEOUT) as c:
            resp = await c.post(f"{target}/v1/replicas", headers=ag.headers(),
                                json={"model": r.model, "layout": self.layouts.get(rid, r.layout),
                                      "engine": r.engine,  # same engine, same vLLM flags
                                      **({"vllm_args": r.vllm_args} if r.vllm_args else {})})
        if resp.status_code >= 400:
            raise HTTPError(502, f"target agent refused the replica ({resp.status_code}): {web.error_message(resp)[:300]}")
        tr = resp.json()
        e.target_replica, e.target_url, e.state = tr["id"], tr["url"], "launched"

    async def move(self, rid: str) -> None:
        from relayout.migrate.protocol.relocate import relocate

        e, src = self.entries[rid], self.ag.reg.replicas[rid].url
        e.state = "migrating"
        self.op.phase = f"migrating {rid}"
        seen = self.live_at_start[rid]  # so a session that finishes here before its turn is still accounted for
        loop = asyncio.get_running_loop()

        def live() -> list[str]:  # in relocate's thread: the listing runs on the agent's loop
            ids = asyncio.run_coroutine_threadsafe(self.sessions_of(src), loop).result()
            seen.update(ids)
            return ids

        # passes re-list: sessions that finish or arrive while the replica is moved (migrate.protocol.relocate)
        rel = await asyncio.to_thread(relocate, live, lambda group: self.migrate_group(rid, src, group),
                                      passes=DRAIN_PASSES)
        e.sessions_moved += [s for s in rel.moved if s not in e.sessions_moved]  # a failed move's committed ones
        e.sessions_finished_here += [s for s in rel.finished_here if s not in e.sessions_finished_here]
        if rel.source_error:
            raise HTTPError(502, rel.source_error)
        await self.account(rid, src, seen, rel)

    def migrate_group(self, rid: str, src: str, group: list[str]) -> MigrationResult:
        """One live migration of `group` (in relocate's thread), its progress into the entry and the op."""
        from relayout.migrate.protocol.live import MigrationPlan, migrate_live, new_transfer_id

        e, op = self.entries[rid], self.op
        base = e.bytes_done

        def progress(phase=None, nbytes=None, *_, **__):
            if phase is not None:
                op.phase = f"{rid}: {phase}"
            if nbytes is not None:
                e.bytes_done = base + nbytes
                op.bytes_done = sum(x.bytes_done for x in self.entries.values())

        tid = new_transfer_id()
        e.transfers.append(tid)  # each migration's id, as both replicas know it
        mr = migrate_live(src, e.target_url or "", group, token=self.ag.token, plan=MigrationPlan(transfer_id=tid),
                          progress=progress)
        self.ag.m.observe_migration(mr)
        e.bytes_done = base + mr.bytes_total
        op.bytes_done = sum(x.bytes_done for x in self.entries.values())
        op.stall_ms = max(op.stall_ms or 0.0, mr.stall_ms)
        e.sessions_moved += [s for s in mr.sessions if s not in e.sessions_moved]
        return mr

    async def account(self, rid: str, src: str, seen: set[str], rel: Relocation) -> None:
        """Name every session seen on the replica: moved, finished here, or not moved with why."""
        e, left = self.entries[rid], rel.left
        # the source's own word settles any session the migration results did not name (e.g. a
        # move whose answer was lost after its commit): released to the target, or finished here
        for sid in sorted(seen - set(left) - set(e.sessions_moved) - set(e.sessions_finished_here)):
            state = await self.session_state(src, sid)
            if state == "migrated":
                e.sessions_moved.append(sid)
            elif state == "finished":
                e.sessions_finished_here.append(sid)
            else:
                e.sessions_not_moved.append({"id": sid, "error": f"not on the source any more (state {state})"})
        for sid in left:
            why = rel.not_moved.get(sid) or rel.last_error.get(sid) or f"still on the source after {DRAIN_PASSES} passes"
            e.sessions_not_moved.append({"id": sid, "error": why})
        e.state = "failed" if left or e.sessions_not_moved else "drained"


router = APIRouter()  # in the agent's authenticated /v1 router (create_agent_app)


def drain_running(ag: Agent) -> bool:
    op = ag.reg.operations.get(ag.drain_op) if ag.drain_op is not None else None
    return op is not None and op.live


@router.post("/drain", status_code=202)
async def drain(body: DrainBody, ag: Agent = Depends(agent_of)):
    if drain_running(ag):
        raise HTTPError(409, f"a drain is already running: operation {ag.drain_op}")
    target = body.target_agent.rstrip("/")
    try:
        async with httpx.AsyncClient(verify=tls_context(), timeout=httpx.Timeout(5.0)) as c:
            h = (await c.get(f"{target}/healthz")).json()
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, TypeError, UnicodeError, OSError) as e:
        raise HTTPError(400, f"target_agent {target} is unreachable: {type(e).__name__}") from None
    if not isinstance(h, dict) or h.get("status") != "ok":
        raise HTTPError(400, f"target_agent {target} is not a healthy relayout agent")
    if h.get("agent_id") == ag.agent_id:
        raise HTTPError(400, "target_agent is this agent: drain to another node")
    if h.get("draining"):
        raise HTTPError(409, f"target_agent {target} is draining itself")
    layouts: dict[str, str | None] = {}
    for rid, lay in (body.layouts or {}).items():
        if not web.ID_RE.fullmatch(rid) or rid not in ag.reg.replicas:
            raise HTTPError(400, f"layouts: no replica {rid!r} on this node")
        layouts[rid] = await asyncio.to_thread(validate_layout, ag.reg.replicas[rid].model, lay)
    into = await check_drain_targets(ag, target, body.target_replicas or {}, layouts)
    ag.draining = True  # from now on: no new replicas here, and the gateways stop routing here
    ag.drain_op = ag.new_op("drain", None, lambda op: drain_node(ag, op, target, layouts, into))
    return {"operation_id": ag.drain_op}


@router.post("/undrain")
async def undrain(ag: Agent = Depends(agent_of)):
    if drain_running(ag):
        raise HTTPError(409, f"drain operation {ag.drain_op} is still running")
    ag.draining = False
    return {"draining": False}
