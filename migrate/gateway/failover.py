"""The gateway's part in a failover (docs/gateway.md): it learns which replicas are protected and by
which standby (each agent lists `protected_to` per replica), and when a stream's replica stops
answering it asks that standby to promote, telling it every token id it forwarded of each broken
session, so the standby prefills those tails instead of regenerating them. Streams broken by the
same death are told in one promotion: it is sent when the standby may promote (its lease lapsed),
not before. Promotion is idempotent and only happens once the source's lease has lapsed, so whoever
asks first (this gateway, the source's agent, the standby itself) gets the same result."""

from __future__ import annotations

import asyncio

import httpx

PROMOTE_TIMEOUT_S = 60.0
MAX_WAIT_S = 30.0  # longest the gateway gathers tokens before it asks (a lease of up to ~20 s)


class Promoter:
    """Protected replicas (URL -> their standby's URL and the protection's id) and the promotions
    this gateway asked for. Methods run on the gateway's loop."""

    def __init__(self) -> None:
        self.standby_of: dict[str, tuple[str, str]] = {}
        self.told: dict[str, dict[str, list[int]]] = {}  # protection -> session -> token ids not sent yet
        self.tasks: dict[str, asyncio.Task] = {}

    def learn(self, replica_url: str, protected_to: object) -> None:
        """What an agent lists of one of its replicas (`protected_to`: {"id", "standby"} or absent)."""
        if isinstance(protected_to, dict) and isinstance(protected_to.get("standby"), str) \
                and isinstance(protected_to.get("id"), str):
            self.standby_of[replica_url] = (protected_to["standby"].rstrip("/"), protected_to["id"])
        else:
            self.standby_of.pop(replica_url, None)

    def standbys(self) -> list[str]:
        """Standby URLs a session may have been promoted on (whether or not an agent lists them)."""
        return list(dict.fromkeys(sb for sb, _ in self.standby_of.values()))

    def replica_lost(self, client: httpx.AsyncClient, headers: dict[str, str], replica_url: str, sid: str,
                     ids: list[int] | None) -> None:
        """A stream of session `sid` on `replica_url` broke: ask its standby (if any) to promote, with
        `ids` (every generated token id forwarded, from the first; None: not known from the first)."""
        ref = self.standby_of.get(replica_url)
        if ref is None or not sid:
            return
        standby, pid = ref
        told = self.told.setdefault(pid, {})
        if ids is not None:
            told[sid] = list(ids)
        if pid not in self.tasks:
            task = asyncio.get_running_loop().create_task(self._promote(client, headers, standby, pid))
            self.tasks[pid] = task
            task.add_done_callback(lambda _t: self._done(client, headers, standby, pid))

    def _done(self, client: httpx.AsyncClient, headers: dict[str, str], standby: str, pid: str) -> None:
        self.tasks.pop(pid, None)
        if self.told.get(pid):  # tokens of streams that broke while the promotion was on its way
            task = asyncio.get_running_loop().create_task(self._promote(client, headers, standby, pid))
            self.tasks[pid] = task
            task.add_done_callback(lambda _t: self._done(client, headers, standby, pid))

    async def _promote(self, client: httpx.AsyncClient, headers: dict[str, str], standby: str, pid: str) -> None:
        try:
            r = await client.get(f"{standby}/v1/standby/{pid}", headers=headers, timeout=5)
            if r.status_code == 200:
                v = r.json()
                if v.get("state") == "standby":  # gather the other broken streams until the lease lapses
                    wait = float(v["promote_after_s"]) - float(v["since_last_round_s"]) + 0.01
                    await asyncio.sleep(min(MAX_WAIT_S, max(0.0, wait)))
            told = self.told.pop(pid, {})
            await client.post(f"{standby}/v1/standby/{pid}/promote", json={"tokens": told, "wait": True},
                              headers=headers, timeout=PROMOTE_TIMEOUT_S)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            self.told.pop(pid, None)  # the stream keeps looking for its session either way
