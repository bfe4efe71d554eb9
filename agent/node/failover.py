"""The agent's health check of its replicas, and the failover it triggers (docs/agent-api.md).

Every RELAYOUT_HEALTH_S seconds (default 1) the agent asks each running replica for its protection
(`GET /v1/protection`: any answer means alive) and remembers it in the registry (`protected_to`:
the protection id and the standby's URL). A protected replica whose process died, or that did not answer two checks
in a row, gets its standby asked to promote (`POST {standby}/v1/standby/{id}/promote` with
`wait`): the standby promotes only once the source's lease has lapsed and the source does not say
it still serves the sessions, so asking is always safe, and promotion is idempotent — whoever
notices first (this check, a gateway on a broken stream, the standby's own lease watch) gets it
done. The outcome is kept in the replica's record as `failover`. A replica found dead when the agent
restarts is handled the same way (its protection was saved in the registry)."""

from __future__ import annotations

import asyncio
import time

import httpx
from relayout.agent.node.registry import ReplicaRecord
from relayout.agent.node.state import Agent
from relayout.engine import web
from relayout.migrate.protocol.states import LIVE_PROTECTION
from relayout.storage.settings import settings

MISSED_CHECKS = 2  # unanswered health checks in a row that count as a failure of a live process
PROMOTE_TIMEOUT_S = 60.0  # the standby waits for the lease to lapse first: a few seconds at most


def health_interval_s() -> float:
    return settings().health_s


class HealthCheck:
    """One agent's watch over its replicas (runs as a task on the agent's loop)."""

    def __init__(self, ag: Agent, interval_s: float | None = None):
        self.ag = ag
        self.interval_s = interval_s if interval_s is not None else health_interval_s()
        self.missed: dict[str, int] = {}
        self.promoting: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        async with Agent.client(httpx.Timeout(max(1.0, self.interval_s), connect=1.0)) as c:
            while True:
                await self.check(c)
                await asyncio.sleep(self.interval_s)

    async def check(self, c: httpx.AsyncClient) -> None:
        rids = list(self.ag.reg.replicas)
        await asyncio.gather(*(self._check_one(c, rid) for rid in rids), return_exceptions=True)

    async def _check_one(self, c: httpx.AsyncClient, rid: str) -> None:
        r = self.ag.reg.replicas.get(rid)
        if r is None:
            return
        status = self.ag.refresh(rid).status
        if status == "running":
            if await self._answers(c, rid, r):
                self.missed.pop(rid, None)
                return
            self.missed[rid] = self.missed.get(rid, 0) + 1
            if self.missed[rid] < MISSED_CHECKS:
                return
        elif status != "dead":
            return  # starting, or stopped on purpose: nothing failed
        prot = r.protected_to
        if prot and not r.failover and rid not in self.promoting:
            task = asyncio.get_running_loop().create_task(self._promote(rid, prot))
            self.promoting[rid] = task
            task.add_done_callback(lambda _t, rid=rid: self.promoting.pop(rid, None))

    async def _answers(self, c: httpx.AsyncClient, rid: str, r: ReplicaRecord) -> bool:
        """Whether the replica answers; records its protection (or that it has none) when it does."""
        try:
            resp = await c.get(f"{r.url}/v1/protection", headers=self.ag.headers())
        except httpx.HTTPError:
            return False
        if resp.status_code >= 500:
            return False
        prot = None
        if resp.status_code == 200:
            try:
                body = resp.json()
                if body.get("state") in LIVE_PROTECTION:
                    prot = {"id": body["protection"], "standby": body["standby"]}
            except (ValueError, KeyError, AttributeError):
                prot = None
        if r.protected_to != prot:
            r.protected_to = prot
            r.failover = None  # a new protection can fail over again
            self.ag.reg.save()
        return True

    async def _promote(self, rid: str, prot: dict) -> None:
        """Ask the standby to promote; keeps asking (each check) while it answers that the lease holds."""
        url = f"{prot['standby'].rstrip('/')}/v1/standby/{prot['id']}/promote"
        try:
            async with Agent.client(PROMOTE_TIMEOUT_S) as c:
                resp = await c.post(url, json={"tokens": {}, "wait": True}, headers=self.ag.headers())
        except httpx.HTTPError as e:
            outcome = {"state": "standby_unreachable", "error": f"{type(e).__name__}: {e}"}
        else:
            if resp.status_code == 200:
                got = resp.json()  # "already": someone else (the standby itself, a gateway) promoted first
                outcome = {"state": "promoted", "sessions": got.get("sessions_promoted", []),
                           "already": got.get("already") == "promoted"}
            else:
                kind = (resp.json().get("error") or {}).get("type") if _is_json(resp) else None
                outcome = {"state": kind or f"http_{resp.status_code}", "error": web.error_message(resp)[:300]}
        r = self.ag.reg.replicas.get(rid)
        if r is None:
            return
        if outcome["state"] in ("lease_held", "standby_unreachable"):
            r.failover_attempt = {**outcome, "at": time.time()}  # tried again at the next failed check
        else:  # promoted, or the standby will never promote (dropped, unknown): done either way
            r.failover = {**outcome, "protection": prot["id"], "standby": prot["standby"], "at": time.time()}
        self.ag.reg.save()


def _is_json(resp: httpx.Response) -> bool:
    try:
        resp.json()
    except ValueError:
        return False
    return True
