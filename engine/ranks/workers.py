"""Rank processes of a multi-device replica, on one host or several.

The driver (the process that schedules) owns the replica. Its ranks — one process per device —
join a torch.distributed group (gloo on CPU, NCCL on CUDA) for the attention all-reduce and the
experts' all-to-all, and take step commands from the driver over a `RankChannel` (TCP, parsed
frames, no pickle). By default the driver spawns every rank on its own host. With a
`RankPlacement` it spawns only its `local_ranks` and waits for the others to join its rank
endpoint from other hosts, where `relayout rank` starts them under torchrun-style variables
(RANK, WORLD_SIZE, LOCAL_RANK; MASTER_ADDR:MASTER_PORT = the driver's endpoint). The driver also
hosts the group's rendezvous store, so one address is all a remote rank needs. This file is the
driver's side (`RankExecutor`); what a rank process runs is `rank_process`.

A rank that dies, hangs, breaks its connection or raises takes the whole replica down with a
`RankFailure` naming it, never a hang. A rank that presents the wrong token is turned away and
the driver keeps waiting; one that loads a different model or expects another world size stops
the launch with the reason.
"""

from __future__ import annotations

import hmac
import multiprocessing as mp
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
from relayout.engine.kv_cache import KVCache
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.layout import Layout
from relayout.engine.model.weights import model_identity
from relayout.engine.ranks.executor import HostPool
from relayout.engine.ranks.rank_channel import (
    ChannelClosed,
    ChannelError,
    Encoded,
    Message,
    RankChannel,
    encode,
    split_hostport,
)
from relayout.engine.ranks.rank_process import RankJoinError, rank_join_timeout_s, rank_main
from relayout.engine.ranks.runner import StepBatch
from relayout.engine.ranks.shared_kv import SharedPool, attach_pool, shared_kv_enabled
from relayout.storage.settings import settings

HELLO_TIMEOUT_S = 15.0  # a connection that says nothing this long is not one of our ranks


class RankFailure(RuntimeError):
    pass


@dataclass
class RankPlacement:
    """Where a replica's ranks run. The default: every rank on this host, spawned by the driver."""

    local_ranks: list[int] | None = None  # None: all of them
    endpoint: str = "127.0.0.1:0"  # where ranks join the driver (port 0: a free one)
    token: str | None = None  # remote ranks must present it (RELAYOUT_TOKEN)
    join_timeout_s: float = field(default_factory=rank_join_timeout_s)


def _spawned_rank(rank: int, driver: str, model_dir: str, token: str | None, threads: int, local_index: int) -> None:
    try:
        code = rank_main(rank, driver, model_dir, token, threads, local_index)
    except RankJoinError as e:
        raise SystemExit(f"rank {rank}: {e}") from None
    raise SystemExit(code)


# ---- the driver side -------------------------------------------------------------------------------
class RankExecutor:
    def __init__(self, cfg: ModelConfig, layout: Layout, model_dir: Path, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, placement: RankPlacement | None = None, kv_dtype: torch.dtype | None = None):
        pl = placement or RankPlacement()
        world = layout.world_size
        self.layout, self.num_kv_heads = layout, cfg.num_kv_heads
        self.local = list(range(world)) if pl.local_ranks is None else sorted(set(pl.local_ranks))
        if any(not 0 <= r < world for r in self.local):
            raise ValueError(f"local ranks {self.local} are outside the layout's {world} ranks")
        self.token = pl.token or None
        self.chans: dict[int, RankChannel] = {}
        self.hosts: dict[int, str] = {}
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self._closed = False
        self.step_timeout_s = settings().step_timeout_s  # read once: _gather runs on every step
        self.shared_pools: dict[int, tuple[KVCache, tuple[int, int]]] = {}  # see _attach_pools
        host, port = split_hostport(pl.endpoint)
        self._listener = socket.create_server((host, port), backlog=64)
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        # the group's rendezvous lives with the driver, so a remote rank needs only the driver's address
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.step_timeout_s))
        self._identity = model_identity(model_dir)
        try:
            local_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
            ctx = mp.get_context("spawn")
            threads = max(1, (os.cpu_count() or 1) // max(1, len(self.local)))
            for i, r in enumerate(self.local):
                p = ctx.Process(target=_spawned_rank, daemon=True, name=f"relayout-rank{r}",
                                args=(r, f"{local_host}:{self._listener.getsockname()[1]}", str(model_dir),
                                      self.token, threads, i))
                p.start()
                self.procs[r] = p
            self._join(world, pl.join_timeout_s)
            conf = {"layout": layout.to_dict(), "num_blocks": num_blocks, "device": device.type,
                    "dtype": str(dtype).removeprefix("torch."),
                    "kv_dtype": str(kv_dtype or dtype).removeprefix("torch."), "store_port": self._store.port}
            for r in range(world):
                # only ranks this driver spawned share its host (and so its /dev/shm)
                self._send(r, "config", {**conf, "shared_kv": r in self.procs and shared_kv_enabled()})
            ready = self._gather(list(range(world)), timeout=pl.join_timeout_s)
            self.shared_pools = self._attach_pools(ready, kv_dtype or dtype, num_blocks)
        except BaseException:
            self.shutdown(force=True)
            raise
        finally:
            self._listener.close()

    def _attach_pools(self, ready: dict[int, Message], dtype: torch.dtype, num_blocks: int
                      ) -> dict[int, tuple[KVCache, tuple[int, int]]]:
        """The KV pools of local ranks that put theirs in shared memory, mapped here (rank ->
        (pool, its KV heads)); empty unless every rank of the replica did, so the driver either
        copies every rank's KV itself or none."""
        pools: dict[int, tuple[KVCache, tuple[int, int]]] = {}
        for r in sorted(ready):
            meta = ready[r].meta if isinstance(ready[r].meta, dict) else {}
            if not meta.get("shared_kv") or r not in self.procs:
                continue
            p = SharedPool.from_dict(meta["shared_kv"])
            k, v = attach_pool(p, self.procs[r].pid)  # type: ignore[arg-type]
            pools[r] = (KVCache(p.num_layers, num_blocks, p.shape[2], p.shape[3], dtype, torch.device("cpu"),
                                tensors=(k, v)), (p.heads[0], p.heads[1]))
        return pools if len(pools) == self.layout.world_size else {}

    # ---- joining -----------------------------------------------------------------------------
    def _join(self, world: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        remote = sorted(set(range(world)) - set(self.local))
        if remote:
            print(f"relayout: waiting for ranks {remote} to join at {self.endpoint} (relayout rank)", file=sys.stderr,
                  flush=True)
        self._listener.settimeout(0.5)
        while len(self.chans) < world:
            for r, p in self.procs.items():
                if r not in self.chans and not p.is_alive():
                    self._fail(f"rank {r} exited (code {p.exitcode}) before joining")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(self.chans))
                hint = f"; start remote ranks with RANK=r MASTER_ADDR:MASTER_PORT={self.endpoint} relayout rank" \
                    if remote else ""
                self._fail(f"ranks {missing} did not join {self.endpoint} within {timeout:.0f}s{hint}")
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            ch = RankChannel(conn)
            try:
                hello = ch.recv(timeout=HELLO_TIMEOUT_S)
            except (ChannelClosed, ChannelError, TimeoutError):
                ch.close()  # not one of ours (or gone already): keep waiting for the real ranks
                continue
            reason, fatal = self._check_hello(hello, world)
            if reason:
                try:
                    ch.send("refuse", {"reason": reason})
                except ChannelClosed:
                    pass
                ch.close()
                if fatal:
                    self._fail(reason)
                continue
            r = hello.meta["rank"]
            self.chans[r], self.hosts[r] = ch, f"{hello.meta.get('host')!s:.100} ({ch.peer})"

    def _check_hello(self, m: Message, world: int) -> tuple[str | None, bool]:
        """(why this connection is refused, whether that stops the launch)."""
        a = m.meta if m.op == "hello" and isinstance(m.meta, dict) else None
        if a is None:
            return "expected a hello", False
        if self.token and not hmac.compare_digest(str(a.get("token", "")).encode(), self.token.encode()):
            return "bad token (set RELAYOUT_TOKEN to the driver's)", False
        r = a.get("rank")
        if not isinstance(r, int) or not 0 <= r < world:
            return f"rank {r!r} is not in 0..{world - 1} (the layout has {world} ranks)", False
        if r in self.chans:
            return f"rank {r} already joined from {self.hosts[r]}", False
        if a.get("world_size") not in (None, world):
            return f"rank {r} expects WORLD_SIZE={a.get('world_size')} but the layout has {world} ranks", True
        theirs = a.get("model") if isinstance(a.get("model"), dict) else {}
        if theirs != self._identity:
            diff = [k for k in sorted(set(self._identity["config"]) | set(theirs.get("config") or {}))
                    if self._identity["config"].get(k) != (theirs.get("config") or {}).get(k)]
            what = f"config differs in {diff[:8]}" if diff else "weight files differ (names or sizes)"
            return f"rank {r} on {a.get('host')!s:.100} loads a different model than the driver: {what}", True
        return None, False

    # ---- messaging ---------------------------------------------------------------------------
    def _send(self, rank: int, op: str, meta: object = None, tensors: list[torch.Tensor] | None = None) -> None:
        self._send_encoded(rank, encode(op, meta, tensors or []))

    def _send_encoded(self, rank: int, msg: Encoded) -> None:
        try:
            self.chans[rank].send_encoded(msg)
        except ChannelClosed as e:
            self._fail(f"rank {rank} on {self.hosts.get(rank)} is gone ({e}){self._exit_code(rank)}")

    def _exit_code(self, rank: int) -> str:
        p = self.procs.get(rank)
        return f", exit code {p.exitcode}" if p is not None and p.exitcode is not None else ""

    def _gather(self, ranks: list[int], timeout: float | None = None) -> dict[int, Message]:
        timeout = self.step_timeout_s if timeout is None else timeout
        pending = set(ranks)
        out: dict[int, Message] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait([self.chans[r] for r in pending] + [p.sentinel for p in self.procs.values()],
                         timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                self._fail(f"ranks {sorted(pending)} did not answer within {timeout:.0f}s")
            for r in sorted(pending):
                if self.chans[r] not in ready:
                    continue
                try:
                    m = self.chans[r].recv(timeout=self.step_timeout_s)
                except (ChannelClosed, ChannelError, TimeoutError) as e:
                    self._fail(f"rank {r} on {self.hosts.get(r)}: {e}{self._exit_code(r)}")
                if m.op == "error":
                    self._fail(f"rank {r} on {self.hosts.get(r)} failed:\n{(m.meta or {}).get('error')}")
                out[r] = m
                pending.discard(r)
            for r, p in self.procs.items():
                if not p.is_alive() and (r in pending or p.exitcode not in (0, None)):
                    self._fail(f"rank {r} died (exit code {p.exitcode})")
        return out

    def _fail(self, msg: str) -> None:
        # a killed rank breaks its peers' collectives, and their reports may come before its own end is
        # seen (a local rank's exit status, a remote rank's closed channel): wait a moment, name it first
        gone: dict[int, tuple[str, str]] = {}  # rank -> (why, what in `msg` already says it)
        chans, sentinels = dict(self.chans), {p.sentinel: r for r, p in self.procs.items()}
        deadline = time.monotonic() + 0.25
        while (chans or sentinels) and (left := deadline - time.monotonic()) > 0:
            ready = wait([*chans.values(), *sentinels], timeout=left)
            for r, ch in [(r, ch) for r, ch in chans.items() if ch in ready]:
                del chans[r]
                try:
                    ch.recv(timeout=0.05)  # what a live rank says now no longer matters: the replica is down
                except (ChannelClosed, ChannelError, TimeoutError):
                    gone.setdefault(r, (f"rank {r} on {self.hosts.get(r)}: connection lost", f"rank {r} "))
            for r in [sentinels.pop(s) for s in list(sentinels) if s in ready]:
                self.procs[r].join(1.0)  # its status is there a moment after its sentinel fires
                if (code := self.procs[r].exitcode) is not None and code < 0:
                    # named even when `msg` is its own broken channel: the signal is the cause
                    gone[r] = (f"rank {r} died (signal {-code})", f"rank {r} died")
        named = [why for r, (why, said) in sorted(gone.items()) if said not in msg]
        self.shutdown(force=True)
        raise RankFailure(f"replica down: {'; '.join([*named, msg])}")

    # ---- Executor ----------------------------------------------------------------------------
    def execute(self, batches: list[StepBatch]) -> list[torch.Tensor]:
        lay = self.layout
        msgs = [encode("step", vars(b)) for b in batches]  # once per DP group, not once per rank
        for r in range(lay.world_size):
            self._send_encoded(r, msgs[lay.dp_group_of(r)])
        res = self._gather(list(range(lay.world_size)))
        return [res[g * lay.attn_tp].tensors[0] for g in range(lay.attn_dp)]

    def _group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.layout.attn_tp, (group + 1) * self.layout.attn_tp))

    def export_kv(self, group: int, blocks: list[int], tok_lo: int, tok_hi: int) -> list[tuple[int, int, torch.Tensor]]:
        ranks = self._group_ranks(group)
        for r in ranks:
            self._send(r, "export", {"blocks": blocks, "tok_lo": tok_lo, "tok_hi": tok_hi})
        res = self._gather(ranks)
        seen: dict[tuple[int, int], torch.Tensor] = {}
        for r in ranks:
            lo, hi = res[r].meta["kv_range"]
            seen.setdefault((lo, hi), res[r].tensors[0].transpose(2, 3))  # replicated KV heads are exported once
        return [(lo, hi, t) for (lo, hi), t in sorted(seen.items())]

    def import_kv(self, group: int, blocks: list[int], tok_lo: int, kv: torch.Tensor) -> None:
        ranks = self._group_ranks(group)
        sent: dict[tuple[int, int], bytes] = {}  # ranks holding the same (replicated) heads share one message
        tokens_major = kv.transpose(2, 3)  # the wire's order: a rank copies whole pool rows from it
        for r in ranks:
            lo, hi = self.layout.kv_head_range(r, self.num_kv_heads)
            if (lo, hi) not in sent:
                # each TP rank gets only the KV heads it holds: 1/attn_tp of the bytes, not all of them
                part = tokens_major[:, :, :, lo:hi] if hi - lo < kv.shape[2] else tokens_major
                sent[(lo, hi)] = encode("import", {"blocks": blocks, "tok_lo": tok_lo, "heads": [lo, hi]},
                                        [part.contiguous()])
            self._send_encoded(r, sent[(lo, hi)])
        self._gather(ranks)

    def own_pool(self) -> HostPool | None:
        return None  # the pools are the ranks' (at most mapped here: host_pools)

    def host_pools(self, group: int, every_copy: bool = False) -> list[HostPool] | None:
        if not self.shared_pools:
            return None
        a = self.layout.attn_tp
        pools = [self.shared_pools[r] for r in range(group * a, (group + 1) * a)]
        return pools if every_copy else list({heads: (kv, heads) for kv, heads in pools}.values())

    def reserve_kv_scratch(self, group: int, n_blocks: int) -> None:
        """Also the proof, every round, that the group's ranks are alive: KV copied into shared pools
        sends them nothing else, and a round must not be acknowledged into a dead rank's memory."""
        ranks = self._group_ranks(group)
        for r in ranks:
            self._send(r, "reserve", {"blocks": n_blocks})
        self._gather(ranks)

    def moe_stats(self) -> list[dict]:
        ranks = list(range(self.layout.world_size))
        for r in ranks:
            self._send(r, "stats")
        res = self._gather(ranks)
        return [res[r].meta for r in ranks]

    def shutdown(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for ch in self.chans.values():
                try:
                    ch.send("stop")
                except ChannelClosed:
                    pass
            for p in self.procs.values():
                p.join(timeout=5)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for ch in self.chans.values():
            ch.close()  # remote ranks see the connection end and exit
        self._store = None  # type: ignore[assignment]
