"""What a rank process runs: join its driver over a `RankChannel`, set up its torch.distributed
group and `ModelRunner`, then serve the driver's commands (step, export, import, reserve, stats,
stop) until told to stop or the driver goes away. The driver side is `workers.RankExecutor`; a rank
on another host is started by `relayout rank` (engine/ranks/rank.py)."""

from __future__ import annotations

import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from relayout.engine.kv_cache import FP8_KV
from relayout.engine.model.config import ModelConfig, parse_dtype
from relayout.engine.model.layout import Layout
from relayout.engine.model.parallel import init_groups
from relayout.engine.model.weights import model_identity
from relayout.engine.ranks.rank_channel import ChannelClosed, RankChannel, split_hostport
from relayout.engine.ranks.runner import ModelRunner, StepBatch
from relayout.storage.format.chunks import one_malloc_arena
from relayout.storage.settings import settings


def rank_join_timeout_s() -> float:  # RELAYOUT_RANK_JOIN_TIMEOUT_S
    return settings().rank_join_timeout_s


class RankJoinError(RuntimeError):
    """Raised in a rank process the driver turned away (or could not be reached)."""


def _connect(driver: str, deadline: float) -> socket.socket:
    host, port = split_hostport(driver)
    while True:  # a remote rank may be started before its driver
        try:
            return socket.create_connection((host, port), timeout=10)
        except OSError as e:
            if time.monotonic() > deadline:
                raise RankJoinError(f"cannot reach the driver at {driver}: {e}") from None
            time.sleep(0.5)


def rank_main(rank: int, driver: str, model_dir: str, token: str | None = None, threads: int | None = None,
              local_index: int | None = None, world_size: int | None = None) -> int:
    """One rank: join the driver at `driver` (HOST:PORT), then run its commands until told to stop
    or the driver goes away (0), or until a command fails (1, reported to the driver). Raises
    RankJoinError when turned away."""
    one_malloc_arena()  # as its driver does (migrate.replica.serve): freed buffers stay for the next round
    if threads:
        torch.set_num_threads(threads)
    sock = _connect(driver, time.monotonic() + rank_join_timeout_s())
    sock.settimeout(None)
    ch = RankChannel(sock)
    try:
        ch.send("hello", {"rank": rank, "token": token or "", "host": socket.gethostname(), "world_size": world_size,
                          "model": model_identity(Path(model_dir))})
        try:
            msg = ch.recv(timeout=rank_join_timeout_s())
        except (ChannelClosed, TimeoutError) as e:
            raise RankJoinError(f"the driver at {driver} did not answer rank {rank}'s hello: {e}") from None
        if msg.op == "refuse":
            raise RankJoinError(f"the driver at {driver} refused rank {rank}: {(msg.meta or {}).get('reason')}")
        if msg.op != "config" or not isinstance(msg.meta, dict):
            raise RankJoinError(f"unexpected {msg.op!r} from the driver at {driver}")
        try:
            runner, first_tp = _start(rank, msg.meta, split_hostport(driver)[0], Path(model_dir), local_index)
            ch.send("ready", {"shared_kv": runner.shared_pool.to_dict() if runner.shared_pool else None})
            _serve(ch, runner, first_tp)
            return 0
        except ChannelClosed:
            return 0  # the driver is gone (or shut the replica down hard): nothing left to serve
        except Exception:
            tb = traceback.format_exc(limit=8)
            print(f"relayout rank {rank} failed:\n{tb}", file=sys.stderr, flush=True)
            try:
                ch.send("error", {"error": tb})
            except ChannelClosed:
                pass
            return 1
    finally:
        ch.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _start(rank: int, conf: dict, store_host: str, model_dir: Path, local_index: int | None
           ) -> tuple[ModelRunner, bool]:
    layout = Layout.from_dict(conf["layout"])
    cfg = ModelConfig.from_dir(model_dir)
    dev = torch.device(conf["device"])
    if dev.type == "cuda":
        dev = torch.device("cuda", (rank if local_index is None else local_index) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=settings().step_timeout_s)
    store = dist.TCPStore(store_host, int(conf["store_port"]), is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=layout.world_size, timeout=timeout)
    ps = init_groups(layout, rank)
    dtype = parse_dtype(conf["dtype"])
    kv_dtype = {str(t).removeprefix("torch."): t for t in (dtype, FP8_KV)}[conf.get("kv_dtype", conf["dtype"])]
    runner = ModelRunner(cfg, ps, model_dir, int(conf["num_blocks"]), dev, dtype, kv_dtype,
                         shared_kv=bool(conf.get("shared_kv")) and local_index is not None)
    return runner, layout.attn_tp_rank(rank) == 0


def _serve(ch: RankChannel, runner: ModelRunner, first_tp: bool) -> None:
    while True:
        m = ch.recv()
        a = m.meta or {}
        if m.op == "step":
            out = runner.execute(StepBatch(**a))
            ch.send("ok", None, [out] if first_tp else [])  # the other TP ranks hold the same logits
        elif m.op == "export":
            kv = runner.export_kv(a["blocks"], a["tok_lo"], a["tok_hi"])
            ch.send("ok", {"kv_range": list(runner.kv_range)}, [kv.transpose(2, 3)])  # token-major on the wire
        elif m.op == "import":
            # token-major on the wire ([layers, 2, tokens, heads, head_dim], the pool's order)
            runner.import_kv(a["blocks"], a["tok_lo"], m.tensors[0].transpose(2, 3), a.get("heads"))
            ch.send("ok")
        elif m.op == "reserve":  # gather buffers for a step over this many blocks (a session moving in)
            runner.kv.reserve_scratch(int(a["blocks"]))
            ch.send("ok")
        elif m.op == "stats":
            ch.send("ok", runner.moe_stats())
        elif m.op == "stop":
            ch.send("ok")
            return
        else:
            raise ValueError(f"unknown command {m.op!r}")
