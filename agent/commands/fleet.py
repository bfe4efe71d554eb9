"""Fleet re-layout controller (docs/layouts.md): the policy for every running replica of every agent.

Each poll lists the replicas of every agent (`GET /v1/replicas`), reads each running one's
expert counters from the replica itself (`GET /v1/replica`, as the agent's listing names its
URL) and feeds them to that replica's own policy state (`ReplicaWatch`, shared with the
single-replica controller in relayout.migrate.placement.controller). A "relayout" decision is carried
out by the replica's own agent: `POST /v1/replicas/{id}/migrate` with target {that agent, the
new layout} launches the new replica there and live-migrates the sessions; the controller
polls the operation, sweeps sessions that arrived meanwhile onto the new replica, hands the
policy state on to the new replica's id (its cooldown with it) and deletes the old replica
after `stop_grace_s`, so clients following `migrated_to` can still ask it where their session
went. An agent URL whose host name resolves to several addresses (a headless Service) stands
for each of them, resolved again at every poll; addresses answering with the same agent id
count once.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from urllib.parse import urlsplit

import httpx
from relayout.engine import web
from relayout.engine.model.layout import Layout
from relayout.engine.tracing import traced
from relayout.migrate.placement.controller import PollLoop, ReplicaWatch, Step
from relayout.migrate.placement.policy import Decision, PolicyConfig, RelayoutPolicy
from relayout.migrate.protocol.live import MigrationResult
from relayout.migrate.protocol.relocate import GONE, relocate

__all__ = ["FleetController", "expand_agents"]

OP_DONE = ("succeeded", "failed", "aborted")


def _split_urls(urls: Iterable[str]) -> list[str]:
    out: list[str] = []
    for u in urls:
        out += [p.strip().rstrip("/") for p in u.replace(" ", ",").split(",") if p.strip()]
    return list(dict.fromkeys(out))


def expand_agents(urls: Iterable[str]) -> list[str]:
    """Comma/space separated agent URLs; a host name with several addresses becomes one URL per address
    (a name with one address, or one that does not resolve, stays as given)."""
    out: list[str] = []
    for url in _split_urls(urls):
        parts = urlsplit(url)
        try:
            addrs = sorted({a[4][0] for a in socket.getaddrinfo(parts.hostname, parts.port or 80,
                                                                 type=socket.SOCK_STREAM)})
        except (socket.gaierror, UnicodeError, TypeError):
            addrs = []
        if len(addrs) <= 1:
            out.append(url)
            continue
        port = parts.port or (443 if parts.scheme == "https" else 80)
        out += [f"{parts.scheme}://{'[' + a + ']' if ':' in a else a}:{port}" for a in addrs]
    return list(dict.fromkeys(out))


class FleetController(PollLoop):
    def __init__(self, agents: Iterable[str], policy: PolicyConfig | None = None, interval: float = 10.0, *,
                 dry_run: bool = False, token: str | None = None, mode: str = "live", stop_grace_s: float = 5.0,
                 sweeps: int = 3, op_poll_s: float = 0.2, op_timeout_s: float = 900.0,
                 log: Callable[[str], None] | None = None, on_operation: Callable[[dict], None] | None = None):
        self.agents = _split_urls(agents)
        if not self.agents:
            raise ValueError("no agent URLs given")
        self.config = policy if policy is not None else PolicyConfig()
        self.interval = interval
        self.dry_run = dry_run
        self.token = token if token is not None else web.env_token()
        self.mode = mode
        self.stop_grace_s = stop_grace_s
        self.sweeps = sweeps
        self.op_poll_s = op_poll_s
        self.op_timeout_s = op_timeout_s
        self.log = log or (lambda s: None)
        self.on_operation = on_operation or (lambda op: None)  # every poll of a migrate operation (progress)
        self.watches: dict[tuple[str, str], ReplicaWatch] = {}  # (agent id, replica id) -> its policy state
        self.retiring: set[tuple[str, str]] = set()  # moved away: deleted after the grace, not watched
        self.history: list[Step] = []
        self._stopping: list[threading.Thread] = []

    def _headers(self) -> dict[str, str]:
        return web.bearer_headers(self.token)

    def _get(self, url: str) -> dict:
        return web.check_response(httpx.get(url, headers=self._headers(), timeout=30), f"GET {url}")

    def new_watch(self) -> ReplicaWatch:
        # one policy state per replica: a copy of the configured settings (each learns its own launch / stall)
        return ReplicaWatch(RelayoutPolicy(PolicyConfig(**asdict(self.config))), dry_run=self.dry_run, log=self.log)

    # ---- the agents ----------------------------------------------------------------------------------
    def agent_urls(self) -> list[tuple[str, str]]:
        """(URL, agent id) of every agent reachable now, each agent once."""
        seen: dict[str, str] = {}
        for url in expand_agents(self.agents):
            try:
                aid = str(httpx.get(f"{url}/healthz", timeout=10).json().get("agent_id") or url)
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                self._record(Step("", Decision("stay", None, 0.0, 0.0, f"agent unreachable: {e}"), agent=url,
                                  error=str(e)))
                continue
            seen.setdefault(aid, url)
        return [(url, aid) for aid, url in seen.items()]

    # ---- one poll ------------------------------------------------------------------------------------
    def run_once(self) -> list[Step]:
        """Observe every running replica of every agent once; returns one step per replica."""
        steps: list[Step] = []
        listed: set[tuple[str, str]] = set()
        for agent, aid in self.agent_urls():
            try:
                listing = self._get(f"{agent}/v1/replicas")
            except (httpx.HTTPError, ValueError, RuntimeError) as e:
                steps.append(self._record(Step("", Decision("stay", None, 0.0, 0.0, f"agent unreachable: {e}"),
                                               agent=agent, error=str(e))))
                continue
            for rec in listing.get("replicas", []):
                key = (aid, str(rec.get("id")))
                listed.add(key)
                if rec.get("status") != "running" or key in self.retiring:
                    continue
                steps.append(self._poll_replica(agent, key, rec, bool(listing.get("draining"))))
        # replicas gone from their agent (deleted, dead) take their policy state with them
        for key in [k for k in self.watches if k not in listed]:
            del self.watches[key]
        self.retiring &= listed
        return steps

    def _poll_replica(self, agent: str, key: tuple[str, str], rec: dict, draining: bool) -> Step:
        rid = key[1]
        try:
            rep = self._get(f"{str(rec['url']).rstrip('/')}/v1/replica")
        except (httpx.HTTPError, ValueError, KeyError, RuntimeError) as e:
            return self._record(Step(rid, Decision("stay", None, 0.0, 0.0, f"replica unreachable: {e}"),
                                     agent=agent, error=str(e)))
        watch = self.watches.setdefault(key, self.new_watch())

        def relayout(step: Step, model: str, layout: Layout) -> None:
            if draining:  # the agent launches nothing while draining; its replicas are leaving anyway
                step.error = "agent is draining: no relayout"
                return
            self._relayout(agent, key, str(rec["url"]).rstrip("/"), rep, step, model, layout)

        step = watch.poll(rid, rep, relayout)
        step.agent = agent
        return self._record(step)

    def _record(self, step: Step) -> Step:
        self.history.append(step)
        self.log(json.dumps(step.to_dict()))
        return step

    # ---- the relayout, by the replica's agent -----------------------------------------------------------
    def _migrate(self, agent: str, rid: str, body: dict, on_operation: Callable[[dict], None] | None = None) -> dict:
        """`POST /v1/replicas/{rid}/migrate` and wait for the operation; returns it when done."""
        r = httpx.post(f"{agent}/v1/replicas/{rid}/migrate", json=body, headers=self._headers(), timeout=60)
        if r.status_code != 202:
            raise RuntimeError(f"migrate answered {r.status_code}: {web.error_message(r)[:300]}")
        oid = r.json()["operation_id"]
        end = time.monotonic() + self.op_timeout_s
        while True:
            op = self._get(f"{agent}/v1/operations/{oid}")
            (on_operation or self.on_operation)(op)
            if op.get("state") in OP_DONE:
                return op
            if time.monotonic() > end:
                raise RuntimeError(f"operation {oid} not done after {self.op_timeout_s:g}s (phase {op.get('phase')})")
            time.sleep(self.op_poll_s)

    @staticmethod
    def _result(op: dict) -> MigrationResult:
        res = op.get("result") or {}
        not_moved = {x["id"]: x.get("error", "") for x in res.get("sessions_not_moved") or []}
        return MigrationResult(transfer_id=op.get("transfer") or op["id"], sessions=list(res.get("sessions") or []),
                               not_moved=not_moved, bytes_total=int(op.get("bytes_total") or 0),
                               stall_ms=float(op.get("stall_ms") or 0.0))

    def _left(self, url: str) -> list[str]:
        return [s["id"] for s in self._get(f"{url}/v1/replica").get("sessions", []) if s.get("state") not in GONE]

    @traced("relayout")  # the re-layout's trace; the agent's operation carries its own spans
    def _relayout(self, agent: str, key: tuple[str, str], url: str, rep: dict, step: Step, model: str,
                  layout: Layout) -> None:
        aid, rid = key
        t0 = time.monotonic()
        launched: list[float] = []

        def phases(op: dict) -> None:  # the launch ends when the agent leaves "resolving target"
            if not launched and op.get("phase") not in ("queued", "resolving target"):
                launched.append(time.monotonic() - t0)
            self.on_operation(op)

        try:
            op = self._migrate(agent, rid, {"target": {"agent": agent, "layout": layout.to_dict(), "model": model},
                                            "mode": self.mode}, phases)
        except (RuntimeError, httpx.HTTPError, ValueError) as e:
            step.error = f"migration failed: {e}"
            return
        step.launch_s = launched[0] if launched else time.monotonic() - t0
        new = (op.get("result") or {}).get("replica") or op.get("target_replica")
        step.new_replica = new
        if op["state"] != "succeeded":
            step.error = f"migration failed: {op.get('error')}"
            try:
                was_migrated = {s["id"] for s in rep.get("sessions", []) if s.get("state") == "migrated"}
                moved = [s["id"] for s in self._get(f"{url}/v1/replica").get("sessions", [])
                         if s.get("state") == "migrated" and s["id"] not in was_migrated]
            except (httpx.HTTPError, ValueError, RuntimeError):
                moved = ["?"]  # cannot tell: keep both replicas
            if not moved:
                # nothing moved: the old replica keeps serving everything; drop the new one
                if new:
                    self._delete(agent, new, 0.0)
                return
            # some sessions already live on the new replica: keep both running, watch both
            step.acted = True
            step.migrations.append(MigrationResult(transfer_id=op["id"], sessions=moved))
            self.watches[(aid, new)] = self.watches.pop(key)
            return
        step.migrations.append(self._result(op))
        step.acted = True
        def sweep(ids: list[str]) -> MigrationResult:
            op = self._migrate(agent, rid, {"target": {"agent": agent, "replica": new}, "sessions": ids,
                                            "mode": self.mode})
            if op["state"] != "succeeded":
                raise RuntimeError(f"sweep failed: {op.get('error')}")
            return self._result(op)

        # sweep again for sessions that arrived meanwhile (migrate.protocol.relocate); the operation above was the first pass
        rel = relocate(lambda: self._left(url), sweep, passes=self.sweeps - 1,
                       failures=(RuntimeError, httpx.HTTPError, ValueError))
        step.migrations += rel.migrations
        not_moved = {sid: why for m in step.migrations[:1] for sid, why in m.kept().items()} | rel.not_moved
        if not_moved:  # the old replica's engine keeps them (a seeded vLLM request): it stays up until they end
            step.error = "sessions not moved: " + "; ".join(f"{k}: {v}" for k, v in sorted(not_moved.items()))
        if rel.errors:  # the old replica keeps the sessions it still has
            step.error = f"migration failed: {rel.errors[-1]}" + (f"; {step.error}" if step.error else "")
        # the policy state (its cooldown) goes on with the new replica
        self.watches[(aid, new)] = self.watches.pop(key)
        if step.error is None:
            self.retiring.add(key)
            self._delete(agent, rid, self.stop_grace_s)

    def _delete(self, agent: str, rid: str, after_s: float) -> None:
        def delete() -> None:
            r = httpx.delete(f"{agent}/v1/replicas/{rid}", headers=self._headers(), timeout=60)
            if r.status_code >= 400 and r.status_code != 404:
                raise RuntimeError(f"{r.status_code} {web.error_message(r)[:200]}")

        self._later(delete, after_s, f"delete-{rid}", f"deleting replica {rid} on {agent}")
