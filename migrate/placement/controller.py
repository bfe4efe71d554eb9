"""Re-layout controller (docs/layouts.md): poll a replica, feed the policy, act on its decisions.

On "relayout": launch a replica with the new layout through `launcher(model, layout) -> url`,
live-migrate every session onto it (`migrate_live`, swept again for sessions that arrived
meanwhile), switch the controlled URL to it and stop the old replica (`launcher.stop(url)`,
after `stop_grace_s` so clients following `migrated_to` can still ask the old replica where
their session went). The default launcher starts replica servers (`procs.replica`) on this host;
the node agent plugs its own.

The per-replica decision loop (`ReplicaWatch`: policy state, model facts, dry run, feedback to the
policy) is shared with the fleet controller (relayout.agent.commands.fleet), which plugs in another relayout
step: the replica's own agent launches the new replica and migrates onto it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from relayout.engine import web
from relayout.engine.model.layout import Layout
from relayout.engine.tracing import traced
from relayout.migrate import procs
from relayout.migrate.placement.policy import Decision, RelayoutPolicy
from relayout.migrate.procs import LaunchError, stop_process
from relayout.migrate.protocol.live import MigrationPlan, MigrationResult, migrate_live
from relayout.migrate.protocol.relocate import GONE, relocate

__all__ = ["Controller", "LaunchError", "PollLoop", "Relayout", "ReplicaWatch", "Step", "SubprocessLauncher"]


class SubprocessLauncher:
    """A replica server (`procs.replica`: --model M --layout <JSON> --port 0) on this host; its output
    goes to a log file (so it outlives the controller); `stop(url)` sends SIGTERM."""

    def __init__(self, host: str = "127.0.0.1", startup_timeout_s: float = 180.0, log_dir: str | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="relayout-replicas-")
        self.extra_args = tuple(extra_args)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}

    def __call__(self, model: str, layout: Layout) -> str:
        fd, log = tempfile.mkstemp(prefix="replica-", suffix=".log", dir=self.log_dir)
        os.close(fd)
        # its own session and a log file: the replica outlives the controller
        proc = procs.replica(json.dumps(layout.to_dict()), None, model, self.extra_args, host=self.host, log=log,
                             new_session=True, timeout=self.startup_timeout_s)
        url = proc.url.rstrip("/")
        self.procs[url], self.logs[url] = proc.p, log
        return url

    def stop(self, url: str) -> bool:
        """Stop a replica this launcher started (False for any other URL)."""
        p = self.procs.pop(url.rstrip("/"), None)
        if p is None:
            return False
        stop_process(p)
        return True

    def stop_all(self) -> None:
        for url in list(self.procs):
            self.stop(url)



@dataclass
class Step:
    """What one poll did."""
    replica: str  # the single-replica controller: its URL; the fleet controller: its id on `agent`
    decision: Decision
    agent: str | None = None  # the fleet controller: the agent serving the replica
    acted: bool = False
    new_replica: str | None = None
    migrations: list[MigrationResult] = field(default_factory=list)
    launch_s: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict:
        where = {"agent": self.agent} if self.agent is not None else {}
        return {**where, "replica": self.replica, "decision": self.decision.to_dict(), "acted": self.acted,
                "new_replica": self.new_replica, "launch_s": round(self.launch_s, 2),
                "migrated_sessions": [s for m in self.migrations for s in m.sessions],
                "bytes": sum(m.bytes_total for m in self.migrations),
                "stall_ms": round(max((m.stall_ms for m in self.migrations), default=0.0), 2), "error": self.error}


Relayout = Callable[[Step, str, Layout], None]
"""The "do the relayout" step: (step, model, new layout) -> None. It moves the replica's sessions onto a
replica with the new layout and records the outcome on the step: `acted` (sessions now live on the new
replica, `new_replica`), `migrations`, `launch_s`, `error`."""


class ReplicaWatch:
    """One replica's decision loop, shared by the single-replica controller and the fleet controller
    (relayout.agent.commands.fleet): its policy state, the model facts the policy needs, the dry-run switch.
    `poll` feeds one observation to the policy and, on "relayout", runs the pluggable relayout step
    and tells the policy how it went (committed, or aborted: the cooldown still applies)."""

    def __init__(self, policy: RelayoutPolicy | None = None, *, dry_run: bool = False,
                 log: Callable[[str], None] | None = None):
        self.policy = policy if policy is not None else RelayoutPolicy()
        self.dry_run = dry_run
        self.log = log or (lambda s: None)
        self._model_filled = False

    def fill_model_facts(self, model: str) -> None:
        """top_k and KV bytes per token from the model's config, unless configured."""
        if self._model_filled:
            return
        self._model_filled = True
        try:
            from relayout.engine.model.config import ModelConfig
            from relayout.engine.model.weights import resolve_model

            cfg = ModelConfig.from_dir(resolve_model(model))
        except Exception as e:  # noqa: BLE001 - a model this host cannot read: keep the configured facts
            self.log(f"controller: cannot read model {model!r} ({e}); using configured top_k / KV bytes")
            return
        pc = self.policy.cfg
        pc.top_k = cfg.top_k
        if not pc.kv_bytes_per_token:
            pc.kv_bytes_per_token = cfg.kv_bytes_per_token

    def poll(self, name: str, rep: dict, relayout: Relayout) -> Step:
        """One observation (`GET /v1/replica`'s answer) of the replica called `name`."""
        model = rep.get("model", "")
        self.fill_model_facts(model)
        decision = self.policy.observe(rep)
        step = Step(name, decision)
        if decision.action == "relayout" and decision.new_layout is not None and not self.dry_run:
            relayout(step, model, decision.new_layout)
            if step.acted:
                moved = sum(len(m.sessions) for m in step.migrations)
                self.policy.committed(decision.new_layout, launch_s=step.launch_s,
                                      stall_ms=max((m.stall_ms for m in step.migrations), default=None),
                                      sessions=moved)
            else:
                self.policy.aborted()
        return step


class PollLoop:
    """What both controllers share: a poll loop that survives a bad poll, and old replicas stopped
    after a grace on background threads (joined by `wait_stopped`)."""

    interval: float
    log: Callable[[str], None]
    _stopping: list[threading.Thread]

    def run_once(self) -> object:
        raise NotImplementedError

    def _later(self, fn: Callable[[], None], after_s: float, name: str, what: str) -> None:
        """Run `fn` after `after_s` seconds (now, inline, if 0); its failure is logged, never raised."""
        def go() -> None:
            time.sleep(after_s)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report, never crash the loop
                self.log(f"controller: {what} failed: {e}")

        if after_s <= 0:
            go()
            return
        t = threading.Thread(target=go, name=name, daemon=True)
        t.start()
        self._stopping.append(t)

    def wait_stopped(self, timeout: float | None = None) -> None:
        """Join the delayed stops of old replicas (tests, shutdown)."""
        for t in self._stopping:
            t.join(timeout)

    def run_forever(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                self.run_once()
            except Exception as e:  # noqa: BLE001 - one bad poll must not end the controller
                self.log(f"controller: poll failed: {e}")
            stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))


class Controller(PollLoop):
    """Watch one replica reached directly; relayout by launching the new replica here (`launcher`) and
    live-migrating onto it."""

    def __init__(self, replica_url: str, launcher: Callable[[str, Layout], str] | None = None,
                 policy: RelayoutPolicy | None = None, interval: float = 10.0, *, dry_run: bool = False,
                 token: str | None = None, mode: str = "live", stop_grace_s: float = 5.0, sweeps: int = 3,
                 log: Callable[[str], None] | None = None):
        self.replica_url = replica_url.rstrip("/")
        self.launcher = launcher if launcher is not None else SubprocessLauncher()
        self.interval = interval
        self.token = token if token is not None else web.env_token()
        self.mode = mode
        self.stop_grace_s = stop_grace_s
        self.sweeps = sweeps
        self.log = log or (lambda s: None)
        self.watch = ReplicaWatch(policy, dry_run=dry_run, log=self.log)
        self.history: list[Step] = []
        self._stopping: list[threading.Thread] = []

    @property
    def policy(self) -> RelayoutPolicy:
        return self.watch.policy

    @property
    def dry_run(self) -> bool:
        return self.watch.dry_run

    def _headers(self) -> dict[str, str]:
        return web.bearer_headers(self.token)

    def _get_replica(self, url: str) -> dict:
        r = httpx.get(f"{url}/v1/replica", headers=self._headers(), timeout=30)
        r.raise_for_status()
        return r.json()

    # ---- one poll ------------------------------------------------------------------------------
    def run_once(self) -> Step:
        url = self.replica_url
        try:
            rep = self._get_replica(url)
        except (httpx.HTTPError, ValueError) as e:
            step = Step(url, Decision("stay", None, 0.0, 0.0, f"replica unreachable: {e}"), error=str(e))
            self._record(step)
            return step
        step = self.watch.poll(url, rep, self._relayout)
        self._record(step)
        return step

    def _record(self, step: Step) -> None:
        self.history.append(step)
        self.log(json.dumps(step.to_dict()))

    @traced("relayout")  # the re-layout's trace: the launch, then the migrations (their own spans)
    def _relayout(self, step: Step, model: str, layout: Layout) -> None:
        old = self.replica_url
        t0 = time.monotonic()
        try:
            new = self.launcher(model, layout)
        except Exception as e:  # noqa: BLE001 - any launcher failure leaves the old replica serving
            step.error = f"launch failed: {e}"
            return
        step.launch_s = time.monotonic() - t0
        step.new_replica = new = new.rstrip("/")

        def live() -> list[str]:
            return [s["id"] for s in self._get_replica(old)["sessions"] if s.get("state") not in GONE]

        plan = MigrationPlan(mode=self.mode)
        # sweep again for sessions that arrived meanwhile (migrate.protocol.relocate)
        rel = relocate(live, lambda ids: migrate_live(old, new, ids, token=self.token, plan=plan), passes=max(1, self.sweeps))
        step.migrations = rel.migrations
        if rel.not_moved:  # the old replica keeps them: it stays up until they end there
            step.error = "sessions not moved: " + "; ".join(f"{k}: {v}" for k, v in sorted(rel.not_moved.items()))
        if rel.errors:
            step.error = f"migration failed: {rel.errors[-1]}" + (f"; {step.error}" if step.error else "")
            if not rel.moved:
                # nothing moved: the old replica keeps serving everything; drop the new one
                self._stop(new, 0.0)
                return
            # some sessions already live on the new replica: keep both running, switch over
        step.acted = True
        self.replica_url = new
        if step.error is None:
            self._stop(old, self.stop_grace_s)

    def _stop(self, url: str, after_s: float) -> None:
        stop = getattr(self.launcher, "stop", None)
        if stop is not None:
            self._later(lambda: stop(url), after_s, f"stop-{url}", f"stopping {url}")
