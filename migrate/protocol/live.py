"""Live migration of sessions between two replicas (any two layouts), over their HTTP routes.

Pre-copy rounds stream every KV chunk the target lacks while the source keeps decoding;
once a round is small (or after `max_rounds`), the source pauses the sessions at a step
boundary and the final round carries the remainder and their state. The source pushes each
round straight to the target (migrate.transport.base): this process coordinates and sees only small
control messages, never the KV. The target imports
and acknowledges (sessions held paused); then the source releases them (the commit) and
the target resumes them. Before the commit the source owns the sessions: any failure
aborts the target's reservations and resumes the sessions on the source.

If the migrator itself dies, the replicas finish the transfer alone (migrate.protocol.transfers):
the source resumes sessions it paused once the transfer has been idle for
RELAYOUT_TRANSFER_TTL_S, after which a late release is refused; the target frees
reservations after that long, and a target holding placed sessions asks the source how the
transfer ended (released → it resumes them, otherwise it drops them).

`on_phase(name)` is called at each phase boundary (migrate.protocol.states.Phase): "pre-copy:K" before pre-copy round K,
"stop-and-copy" before the final round, "prepared" once the target holds the sessions
(before the commit), "committed" once the source released them, "done".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from relayout.engine.tracing import inject_hooks
from relayout.engine.web import bearer_headers, check_response, tls_context
from relayout.migrate.protocol.observe import phase_boundary, round_bytes, traced_migration
from relayout.migrate.protocol.states import FINISHED_ON_SOURCE, IncomingState, Phase, check_transition

PRECOPY_ROUND_BYTES = 256 << 20  # a pre-copy round's KV over all its sessions (the target stages about a round)
# pre-copy is caught up once a round moves at most this: the stop-and-copy round then carries about
# as much. Each round waits for a step boundary on the source, so a round that moves almost nothing
# costs up to a decode step (300 ms at 16k tokens here) for a few tokens' KV
SMALL_ROUND_BYTES = 4 << 20
SLICE_GRAIN = 512  # tokens: the chunks' alignment (engine.moves.snapshot.CHUNK_TOKENS), so a round ends where a chunk does


def round_slice_tokens(round_bytes: int | None, bytes_per_token: int | None, sessions: int) -> int | None:
    """Tokens per session per pre-copy round: `round_bytes` shared by the sessions, in whole chunks.
    Each round waits for a step boundary on the source (hundreds of ms at long contexts on a CPU),
    so rounds should be few and large; the copy itself is off the engine thread, so their size
    costs the decode nothing, and the bound is the memory both sides hold for a round. None (no
    budget, or a source too old to say its KV size): 1024 tokens, 0.2.0's fixed slice."""
    if not round_bytes or not bytes_per_token:
        return 1024 if round_bytes else None
    per_session = round_bytes // bytes_per_token // max(1, sessions)
    return max(SLICE_GRAIN, per_session // SLICE_GRAIN * SLICE_GRAIN)


class MigrationError(RuntimeError):
    def __init__(self, phase: str, message: str, committed_sessions: list[str] | None = None,
                 transfer_id: str | None = None):
        super().__init__(f"migration failed during {phase}: {message}")
        self.phase, self.transfer_id = str(phase), transfer_id  # the id the replicas know the transfer by
        # set when the failure came after the commit: these sessions belong to the target now
        self.committed_sessions = committed_sessions or []


def new_transfer_id() -> str:
    return f"mig-{uuid.uuid4().hex[:16]}"


@dataclass
class PreCopyRound:
    index: int
    bytes: int
    seconds: float
    final: bool
    # where the round went, as the replicas saw it: source_cut_ms (its wait for a step boundary and
    # the cut), source_cpu_s (the source's CPU from the cut to the target's reply), target_receive_ms,
    # target_import_ms, target_cpu_s (the target's from the round's first byte to its KV in the pool);
    # the CPU figures are whole replicas' (rank processes included): a round's own where nothing else runs
    timing: dict[str, float] = field(default_factory=dict)


@dataclass
class MigrationResult:
    transfer_id: str
    sessions: list[str] = field(default_factory=list)  # moved: they run on the target now
    # asked for (or listed on the source) but not moved, each with the source's reason: finished
    # there before the final round, or an engine that keeps it (a seeded vLLM request)
    not_moved: dict[str, str] = field(default_factory=dict)
    rounds: list[PreCopyRound] = field(default_factory=list)
    bytes_total: int = 0
    stall_ms: float = 0.0  # the sessions' pause: from the source's hold to the target's resume
    # the pause after the final round, call by call: target_check_ms, release_ms, commit_ms
    commit_timing: dict[str, float] = field(default_factory=dict)
    retries: int = 0  # pre-copy rounds resumed after a network error
    phase: str = str(Phase.DONE)

    def kept(self) -> dict[str, str]:
        """The sessions the source's engine keeps (not moved, not finished there), with why."""
        return {sid: why for sid, why in self.not_moved.items() if why != FINISHED_ON_SOURCE}


@dataclass(frozen=True)
class MigrationPlan:
    """How a live migration runs (what it moves is the call's `sessions`, where is its two URLs).

    Pre-copy rounds send at most `precopy_slice_tokens` tokens per session each (default: as many
    as make `precopy_round_bytes` over all the sessions, see `round_slice_tokens`), until a round is at
    most `small_bytes` (caught up) or `max_rounds` ran; then the stop-and-copy round. `mode="cold"`
    skips the pre-copy. A pre-copy round cut by a network error is retried (`retries` times) from the
    chunks the target acknowledges holding; the final round is not retried (the sessions are paused).
    `source_for_target`: the source's URL as the target can reach it (default the source's URL);
    `target_for_source`: the target's URL as the source can reach it (default the target's URL).
    `transport`: how the source pushes the rounds, "http", "tcp" or "mooncake" (default: the source's
    RELAYOUT_TRANSPORT). `transfer_id`: the id the replicas will know this transfer by (default a new
    `new_transfer_id()`); the result, and a MigrationError, carry it."""

    mode: str = "live"
    max_rounds: int = 64
    small_bytes: int = SMALL_ROUND_BYTES
    codec: str = "none"
    precopy_slice_tokens: int | None = None
    precopy_round_bytes: int | None = PRECOPY_ROUND_BYTES
    retries: int = 3
    timeout_s: float = 300.0
    source_for_target: str | None = None
    target_for_source: str | None = None
    transport: str | None = None
    transfer_id: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("live", "cold"):
            raise ValueError("mode must be 'live' or 'cold'")
        if self.max_rounds < 0 or self.retries < 0 or self.timeout_s <= 0:
            raise ValueError("max_rounds and retries must be >= 0, timeout_s > 0")


Progress = Callable[[str, int], None]  # (phase, bytes so far)
OnPhase = Callable[[str], None]


class RoundNotDelivered(RuntimeError):
    """The source could not push a round to the target because the link failed (a cut, a refused
    connection, a timeout): the round may be resumed from the chunks the target acknowledges."""


@dataclass
class _Link:
    """One migration's view of its two replicas: the URLs each side is reached by, and the client."""

    client: httpx.Client
    src: str
    dst: str  # the target as this process reaches it
    push_to: str  # ... and as the source reaches it
    back: str  # the source as the target reaches it
    transfer: str
    plan: MigrationPlan
    token: str | None
    timing: dict[str, float] = field(default_factory=dict)  # the last round's (PreCopyRound.timing)

    def headers(self) -> dict[str, str]:
        return bearer_headers(self.token)

    def target_state(self, what: str) -> dict:
        return check_response(self.client.get(f"{self.dst}/v1/sessions/transfers/{self.transfer}",
                                              headers=self.headers()), what)

    def round(self, sessions: list[str], final: bool, slice_tokens: int | None = None,
              have: list[str] | None = None) -> tuple[dict, int, dict[str, str] | None]:
        """One round: the source pushes it to the target and answers with the target's reply; only
        that small answer comes here. Returns (target reply, bytes moved, the sessions asked for that
        the round does not carry, with the source's reason)."""
        p = self.plan
        body: dict = {"transfer": self.transfer, "sessions": sessions, "pause": final, "codec": p.codec,
                      "target": self.push_to, "timeout_s": p.timeout_s,
                      "source": self.back}  # whom the target asks if this migrator disappears
        if slice_tokens and not final:
            body["max_tokens"] = slice_tokens
        if have is not None:
            body["have"] = have  # a retried round: chunks the target already holds are not resent
        if p.transport:
            body["transport"] = p.transport  # how the source pushes; default: its RELAYOUT_TRANSPORT
        # the source sends a space every second while it pushes: the read timeout measures its silence
        resp = self.client.post(f"{self.src}/v1/sessions/export", json=body, headers=self.headers())
        check_response(resp, "source export")
        try:
            doc = json.loads(resp.content)
        except ValueError:
            raise RuntimeError("source export: the answer is not JSON") from None
        if not isinstance(doc, dict):
            raise RuntimeError("source export: the answer is not a JSON object")
        if "error" in doc:
            msg = f"source push: {(doc.get('error') or {}).get('message', 'failed')}"
            raise RoundNotDelivered(msg) if doc.get("retryable") else RuntimeError(msg)
        reply = doc["reply"] if isinstance(doc.get("reply"), dict) else {}
        self.timing = {f"{side}_{k}": float(v) for side, key in (("source", "source_timing"), ("target", "timing"))
                       for k, v in (reply[key] if isinstance(reply.get(key), dict) else {}).items()
                       if isinstance(v, int | float)}
        not_moved = doc.get("not_moved")  # None: a source from before 0.6.0, which does not name them
        if not_moved is not None and not isinstance(not_moved, dict):
            raise RuntimeError("source export: not_moved is not an object")
        return doc["reply"], int(doc.get("bytes", 0)), None if not_moved is None else {
            str(k): str(v) for k, v in not_moved.items()}

    def precopy_round(self, sessions: list[str], slice_tokens: int | None, res: MigrationResult) -> int:
        """A pre-copy round, resumed after a network error from what the target kept; its bytes."""
        have: list[str] | None = None
        for attempt in range(self.plan.retries + 1):
            try:
                return self.round(sessions, False, slice_tokens, have)[1]
            except (httpx.TransportError, RoundNotDelivered):
                if attempt == self.plan.retries:
                    raise
                time.sleep(0.2 * (attempt + 1))
                # what the target kept of the cut round (hash-verified chunks): resume after them
                st = self.target_state("target state")
                if st.get("incoming") != IncomingState.RECEIVING:
                    raise
                have = list(st.get("chunks") or [])
                res.retries += 1
        raise AssertionError("unreachable")

    def commit_target(self, tries: int = 3) -> None:
        """Tell the target to resume; idempotent on its side, so a lost answer is simply asked again."""
        for attempt in range(tries):
            try:
                check_response(self.client.post(f"{self.dst}/v1/sessions/transfers/{self.transfer}/commit",
                                                headers=self.headers()), "target commit")
                return
            except (httpx.TransportError, RuntimeError):
                if attempt == tries - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def abort(self, paused: list[str]) -> None:
        for url in (f"{self.dst}/v1/sessions/transfers/{self.transfer}",
                    f"{self.src}/v1/sessions/transfers/{self.transfer}"):
            try:
                self.client.request("DELETE", url, headers=self.headers(), timeout=10)
            except httpx.HTTPError:
                pass  # a dead target's reservations die with it
        try:
            # resume everything we may have paused (a no-op for sessions that were never paused)
            self.client.post(f"{self.src}/v1/sessions/resume", json={"sessions": paused}, headers=self.headers(),
                             timeout=10)
        except httpx.HTTPError:
            pass


@dataclass
class MigrationRun:
    """One migration while it runs: what each stage reads and leaves for the next."""

    link: _Link
    plan: MigrationPlan
    res: MigrationResult
    ids: list[str] | None  # the sessions to move (None: all, named by the first stage)
    progress: Progress | None
    on_phase: OnPhase | None
    label: str = str(Phase.PRE_COPY)  # what a failure says it failed during
    paused: list[str] = field(default_factory=list)  # what an abort resumes on the source
    committed: bool = False  # the source released the sessions: they belong to the target
    t_hold: float = 0.0  # when the sessions stopped on the source (the stall starts)

    def at(self, name: str) -> None:
        name = str(name)  # a Phase is its wire string; spans and callers get plain str
        phase_boundary(name)
        if self.on_phase:
            self.on_phase(name)

    def count(self, n: int, seconds: float, final: bool) -> None:
        self.res.rounds.append(PreCopyRound(len(self.res.rounds), n, seconds, final, dict(self.link.timing)))
        round_bytes(n, seconds)
        self.res.bytes_total += n


def _ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


def precopy(run: MigrationRun) -> Phase:
    """Name the sessions, then bounded pre-copy rounds (none when cold) while the source keeps decoding."""
    link, plan, res = run.link, run.plan, run.res
    slice_tokens = plan.precopy_slice_tokens
    size_rounds = plan.mode == "live" and slice_tokens is None  # from the source's KV size
    rep = (check_response(link.client.get(f"{link.src}/v1/replica", headers=link.headers()), "source replica")
           if run.ids is None or size_rounds else {})
    if run.ids is None:  # name them now, so an abort knows exactly what to resume
        run.ids = [s["id"] for s in rep["sessions"]]
    if size_rounds:
        slice_tokens = round_slice_tokens(plan.precopy_round_bytes, rep.get("kv_bytes_per_token"), len(run.ids))
    for i in range(plan.max_rounds if plan.mode == "live" else 0):
        run.at(f"{Phase.PRE_COPY}:{i}")
        t0 = time.perf_counter()
        # bounded slices per round: the source's decoding never waits on a long copy
        n = link.precopy_round(run.ids, slice_tokens, res)
        run.count(n, time.perf_counter() - t0, False)
        if run.progress:
            run.progress(run.label, res.bytes_total)
        if n <= plan.small_bytes or not run.ids:
            break
    return Phase.STOP_AND_COPY


def stop_and_copy(run: MigrationRun) -> Phase:
    """The final round: the source pauses the sessions and sends the rest and their state; then the
    target must still hold exactly them (a target that died after its acknowledgement is caught here)."""
    run.label = str(Phase.STOP_AND_COPY)
    run.at(Phase.STOP_AND_COPY)
    link, res, ids = run.link, run.res, run.ids or []
    run.t_hold = time.perf_counter()
    run.paused = list(ids)
    reply, n, named = link.round(ids, True)
    res.sessions = run.paused = list(reply.get("placed", reply["sessions"]))
    res.not_moved = named or {}
    # every session asked for is either placed on the target or named with the source's reason
    # (an older source names none: then only the placed ones are checked)
    unnamed = set(ids) - set(res.sessions) - set(res.not_moved) if named is not None else set()
    if unnamed or not set(res.sessions) <= set(ids):
        raise RuntimeError(f"the final round placed {sorted(res.sessions)} for {sorted(ids)}; "
                           f"{sorted(unnamed)} neither moved nor named by the source")
    run.count(n, time.perf_counter() - run.t_hold, True)
    run.label = "commit"
    t_c = time.perf_counter()
    st = link.target_state("target check")
    res.commit_timing["target_check_ms"] = _ms_since(t_c)
    if st.get("incoming") != IncomingState.PLACED or sorted(st.get("placed", [])) != sorted(res.sessions):
        raise RuntimeError(f"target no longer holds the transfer ({st.get('incoming')})")
    return Phase.PREPARED


def release(run: MigrationRun) -> Phase:
    """The commit point: the source releases the sessions to the target."""
    run.at(Phase.PREPARED)
    link, res = run.link, run.res
    t_c = time.perf_counter()
    check_response(link.client.post(f"{link.src}/v1/sessions/release", headers=link.headers(), json={
        "sessions": res.sessions, "migrated_to": link.push_to, "transfer": link.transfer}), "source release")
    run.committed = True
    res.commit_timing["release_ms"] = _ms_since(t_c)
    return Phase.COMMITTED


def resume_on_target(run: MigrationRun) -> Phase:
    """The target resumes the sessions; the source's record of the transfer is tidied away."""
    run.at(Phase.COMMITTED)
    link, res = run.link, run.res
    t_c = time.perf_counter()
    link.commit_target()
    res.commit_timing["commit_ms"] = _ms_since(t_c)
    res.stall_ms = (time.perf_counter() - run.t_hold) * 1000
    try:  # tidy-up only: the source already forgot the transfer when it released it
        link.client.request("DELETE", f"{link.src}/v1/sessions/transfers/{link.transfer}", headers=link.headers(),
                            timeout=5)
    except httpx.HTTPError:
        pass  # e.g. the source died right after the commit; the sessions run on the target
    if run.progress:
        run.progress(str(Phase.DONE), res.bytes_total)
    return Phase.DONE


# The migrator's phases in the order states.TRANSITIONS[Phase] allows: each stage returns the next phase
STAGES: dict[Phase, Callable[[MigrationRun], Phase]] = {
    Phase.PRE_COPY: precopy,
    Phase.STOP_AND_COPY: stop_and_copy,
    Phase.PREPARED: release,
    Phase.COMMITTED: resume_on_target,
}


def run_stages(run: MigrationRun) -> MigrationResult:
    phase = Phase.PRE_COPY
    try:
        while phase in STAGES:
            phase = check_transition(phase, STAGES[phase](run))
        run.at(Phase.DONE)
        return run.res
    except Exception as e:
        t = run.res.transfer_id
        if run.committed:
            # the target owns the sessions; it holds them paused until told to resume
            raise MigrationError(run.label, f"{e} (sessions committed to the target; it resumes them by itself "
                                            "once its transfer lease sees the source's release)",
                                 committed_sessions=run.res.sessions, transfer_id=t) from e
        run.link.abort(run.paused)
        raise MigrationError(run.label, f"{e}; the sessions continue on the source", transfer_id=t) from e


@traced_migration  # the migration's trace: a span per phase (migrate.protocol.observe)
def migrate_live(source_url: str, target_url: str, sessions: list[str] | None = None, *,
                 plan: MigrationPlan | None = None, token: str | None = None,
                 progress: Progress | None = None, on_phase: OnPhase | None = None) -> MigrationResult:
    """Move `sessions` (default: all, named when the migration starts) from the source replica to the
    target replica, as `plan` says (default `MigrationPlan()`). The source pushes each round to the
    target itself; this process sees only control messages. `progress(phase, bytes so far)` after
    each round, `on_phase(name)` at each phase boundary."""
    plan = plan or MigrationPlan()
    src, dst = source_url.rstrip("/"), target_url.rstrip("/")
    res = MigrationResult(transfer_id=plan.transfer_id or new_transfer_id())
    with httpx.Client(verify=tls_context(), timeout=plan.timeout_s, event_hooks=inject_hooks()) as client:
        link = _Link(client, src, dst, (plan.target_for_source or dst).rstrip("/"), plan.source_for_target or src,
                     res.transfer_id, plan, token)
        return run_stages(MigrationRun(link, plan, res, sessions, progress, on_phase))
