"""Rank processes of a multi-device replica.

The driver (the process that schedules) starts one process per rank; ranks join a
torch.distributed group (gloo on CPU, NCCL on CUDA) for the attention all-reduce and the
experts' all-to-all, and take step commands from the driver over a pipe. A rank that
dies or raises takes the whole replica down with a `RankFailure` naming it, never a hang.
Across hosts the same `rank_main` runs under torchrun-style variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): see `relayout rank`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.layout import Layout
from engine.parallel import init_groups
from engine.runner import ModelRunner, StepBatch

STEP_TIMEOUT_S = float(os.environ.get("RELAYOUT_STEP_TIMEOUT_S", 300))


class RankFailure(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_main(rank: int, layout_d: dict, model_dir: str, num_blocks: int, device: str, dtype: str,
              master: str, conn: Connection, threads: int) -> None:
    try:
        torch.set_num_threads(threads)
        layout = Layout.from_dict(layout_d)
        cfg = ModelConfig.from_dir(model_dir)
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://{master}",
                                rank=rank, world_size=layout.world_size, timeout=timedelta(seconds=STEP_TIMEOUT_S))
        ps = init_groups(layout, rank)
        runner = ModelRunner(cfg, ps, Path(model_dir), num_blocks, dev, getattr(torch, dtype))
        conn.send(("ready", None))
        first_tp = layout.attn_tp_rank(rank) == 0
        while True:
            op, args = conn.recv()
            if op == "step":
                out = runner.execute(args)
                conn.send(("ok", out if first_tp else None))
            elif op == "export":
                conn.send(("ok", (runner.kv_range, runner.export_kv(*args))))
            elif op == "import":
                runner.import_kv(*args)
                conn.send(("ok", None))
            elif op == "stats":
                conn.send(("ok", runner.moe_stats()))
            elif op == "stop":
                conn.send(("ok", None))
                break
    except Exception:
        try:
            conn.send(("error", traceback.format_exc(limit=8)))
        except Exception:
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class RankExecutor:
    def __init__(self, cfg: ModelConfig, layout: Layout, model_dir: Path, num_blocks: int, device: torch.device,
                 dtype: torch.dtype):
        self.layout = layout
        ctx = mp.get_context("spawn")
        master = f"127.0.0.1:{free_port()}"
        threads = max(1, (os.cpu_count() or 1) // layout.world_size)
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for r in range(layout.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, daemon=True, name=f"relayout-rank{r}",
                            args=(r, layout.to_dict(), str(model_dir), num_blocks, device.type,
                                  str(dtype).removeprefix("torch."), master, child, threads))
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._closed = False
        self._gather(list(range(layout.world_size)), timeout=600)

    # ---- messaging -------------------------------------------------------
    def _send(self, rank: int, op: str, args: object = None) -> None:
        try:
            self.conns[rank].send((op, args))
        except (BrokenPipeError, OSError):
            self._fail(f"rank {rank} is gone (exit code {self.procs[rank].exitcode})")

    def _gather(self, ranks: list[int], timeout: float = STEP_TIMEOUT_S) -> dict[int, object]:
        pending = set(ranks)
        out: dict[int, object] = {}
        while pending:
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in range(len(self.procs))]
            ready = wait(waitables, timeout=timeout)
            if not ready:
                self._fail(f"ranks {sorted(pending)} did not answer within {timeout:.0f}s")
            for r in list(pending):
                c = self.conns[r]
                if c in ready or c.poll():
                    try:
                        status, val = c.recv()
                    except (EOFError, OSError):
                        self._fail(f"rank {r} exited with code {self.procs[r].exitcode}")
                    if status == "error":
                        self._fail(f"rank {r} failed:\n{val}")
                    out[r] = val
                    pending.discard(r)
            for r, p in enumerate(self.procs):
                if not p.is_alive() and (r in pending or p.exitcode not in (0, None)):
                    self._fail(f"rank {r} died (exit code {p.exitcode})")
        return out

    def _fail(self, msg: str) -> None:
        self.shutdown(force=True)
        raise RankFailure(f"replica down: {msg}")

    # ---- Executor --------------------------------------------------------
    def execute(self, batches: list[StepBatch]) -> list[torch.Tensor]:
        lay = self.layout
        for r in range(lay.world_size):
            self._send(r, "step", batches[lay.dp_group_of(r)])
        res = self._gather(list(range(lay.world_size)))
        return [res[g * lay.attn_tp] for g in range(lay.attn_dp)]  # type: ignore[misc]

    def _group_ranks(self, group: int) -> list[int]:
        return list(range(group * self.layout.attn_tp, (group + 1) * self.layout.attn_tp))

    def export_kv(self, group: int, blocks: list[int], tok_lo: int, tok_hi: int) -> list[tuple[int, int, torch.Tensor]]:
        ranks = self._group_ranks(group)
        for r in ranks:
            self._send(r, "export", (blocks, tok_lo, tok_hi))
        res = self._gather(ranks)
        seen: dict[tuple[int, int], torch.Tensor] = {}
        for r in ranks:
            (lo, hi), t = res[r]  # type: ignore[misc]
            seen.setdefault((lo, hi), t)  # replicated KV heads are exported once
        return [(lo, hi, t) for (lo, hi), t in sorted(seen.items())]

    def import_kv(self, group: int, blocks: list[int], tok_lo: int, kv: torch.Tensor) -> None:
        ranks = self._group_ranks(group)
        for r in ranks:
            self._send(r, "import", (blocks, tok_lo, kv))
        self._gather(ranks)

    def moe_stats(self) -> list[dict]:
        for r in range(self.layout.world_size):
            self._send(r, "stats")
        res = self._gather(list(range(self.layout.world_size)))
        return [res[r] for r in range(self.layout.world_size)]  # type: ignore[misc]

    def shutdown(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for c in self.conns:
                try:
                    c.send(("stop", None))
                except (BrokenPipeError, OSError):
                    pass
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
