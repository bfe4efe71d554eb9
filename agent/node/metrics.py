"""The node agent's Prometheus metrics (docs/observability.md): what its operations moved and how
long they took (stall per session, bytes and seconds per pre-copy round, throughput, checkpoint and
restore time), operations failed or aborted by phase, and per-replica sessions and KV blocks as
last seen at a scrape. deploy/grafana/relayout.json charts them."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# a session's stall is milliseconds on loopback, seconds across a slow network
STALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTE_BUCKETS = tuple(float(1 << k) for k in range(10, 38, 3))  # 1 KiB .. 128 GiB
SECOND_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
THROUGHPUT_BUCKETS = tuple(float(1 << k) for k in range(20, 38, 2))  # 1 MiB/s .. 128 GiB/s


class AgentMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # prometheus_client adds `_total` to counters in the exposition
        self.ops = Counter("relayout_agent_operations", "Operations by kind and outcome", ["kind", "outcome"],
                           registry=r)
        self.bytes = Counter("relayout_agent_bytes_moved", "Checkpoint/transfer bytes moved", registry=r)
        self.failed = Counter("relayout_operations_failed", "Operations that failed or were aborted, by kind and "
                              "the phase they were in", ["kind", "phase", "outcome"], registry=r)
        self.running = Gauge("relayout_operations_running", "Operations running now, by kind", ["kind"], registry=r)
        self.op_seconds = Histogram("relayout_operation_seconds", "Operation wall time by kind and outcome",
                                    ["kind", "outcome"], buckets=SECOND_BUCKETS, registry=r)
        self.replicas = Gauge("relayout_agent_replicas", "Replicas by status", ["status"], registry=r)
        self.sessions = Gauge("relayout_agent_sessions", "Live sessions on this node's replicas (last seen)",
                              registry=r)
        self.draining = Gauge("relayout_agent_draining", "1 while this node drains (no new replicas or sessions)",
                              registry=r)
        self.stall = Histogram("relayout_migration_stall_seconds", "Pause of each migrated session: from the "
                               "source's hold to the target's resume", buckets=STALL_BUCKETS, registry=r)
        self.round_bytes = Histogram("relayout_migration_round_bytes", "Bytes of each migration round "
                                     "(round: pre-copy or final)", ["round"], buckets=BYTE_BUCKETS, registry=r)
        self.round_seconds = Histogram("relayout_migration_round_seconds", "Duration of each migration round",
                                       ["round"], buckets=SECOND_BUCKETS, registry=r)
        self.throughput = Histogram("relayout_transfer_throughput_bytes_per_second", "Bytes per second of each "
                                    "transfer (kind: migration or checkpoint)", ["kind"],
                                    buckets=THROUGHPUT_BUCKETS, registry=r)
        self.checkpoint_seconds = Histogram("relayout_checkpoint_seconds", "Time to write a checkpoint",
                                            buckets=SECOND_BUCKETS, registry=r)
        self.restore_seconds = Histogram("relayout_restore_seconds", "Time to restore a checkpoint into a running "
                                         "replica (the launch of a new one not included)", buckets=SECOND_BUCKETS,
                                         registry=r)
        self.replication_lag = Histogram("relayout_replication_lag_tokens", "Replication lag of each protected "
                                         "session at a scrape: tokens its source generated that its standby does "
                                         "not hold yet", ["replica"], registry=r,
                                         buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
        self.replica_sessions = Gauge("relayout_replica_sessions", "Live sessions per replica (at the scrape)",
                                      ["replica", "model"], registry=r)
        self.replica_kv_used = Gauge("relayout_replica_kv_blocks_used", "KV cache blocks in use per replica",
                                     ["replica"], registry=r)
        self.replica_kv_total = Gauge("relayout_replica_kv_blocks_total", "KV cache blocks per attention-DP group "
                                      "per replica", ["replica"], registry=r)
        # the histograms with labels appear from the first scrape on, before any operation ran
        for rnd in ("pre-copy", "final"):
            self.round_bytes.labels(rnd)
            self.round_seconds.labels(rnd)
        for kind in ("migration", "checkpoint"):
            self.throughput.labels(kind)

    def observe_migration(self, res: Any) -> None:
        """One finished migrate_live (a MigrationResult)."""
        for _ in res.sessions:
            self.stall.observe(res.stall_ms / 1000)
        seconds = 0.0
        for rnd in res.rounds:
            label = "final" if rnd.final else "pre-copy"
            self.round_bytes.labels(label).observe(rnd.bytes)
            self.round_seconds.labels(label).observe(rnd.seconds)
            seconds += rnd.seconds
        if seconds > 0 and res.bytes_total:
            self.throughput.labels("migration").observe(res.bytes_total / seconds)

    def observe_checkpoint(self, nbytes: int, seconds: float) -> None:
        self.checkpoint_seconds.observe(seconds)
        if seconds > 0 and nbytes:
            self.throughput.labels("checkpoint").observe(nbytes / seconds)

    def observe_replica(self, rid: str, model: str, info: dict) -> None:
        """A replica's `GET /v1/replica` answer, as seen at a scrape."""
        self.replica_sessions.labels(rid, model).set(len(info.get("sessions") or []))
        if info.get("kv_blocks_used") is not None:
            self.replica_kv_used.labels(rid).set(info["kv_blocks_used"])
        if info.get("num_blocks") is not None:
            self.replica_kv_total.labels(rid).set(info["num_blocks"])

    def observe_protection(self, rid: str, protection: dict) -> None:
        """A protected replica's `GET /v1/protection` answer, as seen at a scrape."""
        for s in protection.get("sessions") or []:
            if isinstance(s.get("lag_tokens"), int):
                self.replication_lag.labels(rid).observe(s["lag_tokens"])

    def forget_replica(self, rid: str, model: str) -> None:
        for g, labels in ((self.replica_sessions, (rid, model)), (self.replica_kv_used, (rid,)),
                          (self.replica_kv_total, (rid,))):
            try:
                g.remove(*labels)
            except KeyError:
                pass

    @staticmethod
    def phase_label(phase: str | None) -> str:
        """A low-cardinality phase name: "r-1a2b: pre-copy:3" -> "pre-copy", "migrating r-1a2b" -> "migrating"."""
        words = (phase or "unknown").rsplit(": ", 1)[-1].split()
        return (words[0] if words else "unknown").split(":")[0]

    def finished(self, kind: str, state: str, phase: str, seconds: float, nbytes: int) -> None:
        """An operation ended in `state` (succeeded, failed, aborted) during `phase`."""
        self.ops.labels(kind, state).inc()
        self.op_seconds.labels(kind, state).observe(seconds)
        if state != "succeeded":
            self.failed.labels(kind, self.phase_label(phase), state).inc()
        if nbytes:
            self.bytes.inc(nbytes)
