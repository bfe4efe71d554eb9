"""`relayout bench datapath` (docs/benchmarks.md): a cold round's data path on its own, beside a bare
socket copy of the same bytes in the same run.

The path is the product's: a process holding a KV pool cuts one session's KV as a final round does
(in-place chunks of the pool's rows, engine.moves.snapshot), writes them through CheckpointWriter into a
FrameSink that names their entries, and sends the pieces with the frame link's `sendmsg` batches;
this process receives them with StreamReceiver, which writes each chunk into the blocks of a target's
pools as it arrives (engine.moves.kv_stream; the pools split the heads as a TP target's ranks do). No
replica, decode step, HTTP or engine thread runs: each side's CPU per GB is the path's own, and the
bare copy (bench.replica_client.link_copy, distinct bytes: memory of its own at both ends, as the
round's) is what any path must spend. Every received chunk is checked against the source's KV."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import time
from collections.abc import Callable, Iterator

Log = Callable[[str], None]
LAYERS, HEADS, HEAD_DIM = 8, 8, 128  # builtin:bench's KV geometry (float32, 64 KiB per token)


@contextlib.contextmanager
def _connected(send: Callable[[int, int, mp.Queue], None], tokens: int) -> Iterator[tuple[socket.socket, dict]]:
    """A spawned process running `send(port, tokens, queue)`, connected to this one: the connection,
    told to start; once the block has read to the end, the sender's figures fill the dict."""
    q: mp.Queue = mp.get_context("spawn").Queue()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        proc = mp.get_context("spawn").Process(target=send, args=(srv.getsockname()[1], tokens, q), daemon=True)
        proc.start()
        conn, _ = srv.accept()
        sent: dict = {}
        with conn:
            conn.sendall(b"g")
            yield conn, sent
            conn.sendall(b"d")
        sent.update(q.get(timeout=60))
        proc.join(30)


def _pool(heads: int, blocks: int, seed: int | None = None):
    import torch
    from relayout.engine.kv_cache import KVCache

    p = KVCache(LAYERS, blocks, heads, HEAD_DIM, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed or 0)
    for t in p.k + p.v:  # paged in, as a serving replica's pool is
        if seed is None:
            t.fill_(0.5)
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    return p


def _send(port: int, tokens: int, out: mp.Queue) -> None:
    """The source: one session's KV of `tokens` as a final round's frames, sent with the frame link's batches."""
    import resource

    from relayout.engine.moves.snapshot import _in_place_chunks, _put_chunks
    from relayout.migrate.transport.frame_link import _batches, _send_all
    from relayout.migrate.transport.frame_sink import FrameOptions, FrameSink
    from relayout.storage.checkpoint import CheckpointWriter
    from relayout.storage.format.manifest import KVGeometry, ModelRef

    blocks = list(range(tokens // 16 + 1))
    src = _pool(HEADS, len(blocks), seed=7)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def frames():
            sink = FrameSink(set(), FrameOptions(entries=True))
            sink.kv_tokens = {"s": tokens}
            w = CheckpointWriter(sink, "datapath")
            for c in _in_place_chunks(src, (0, HEADS), blocks, 0, tokens):  # as a final round: one at a time
                _put_chunks(w, "s", [c])
                yield from sink.take()
            w.add_session("s", {}, tokens)
            w.commit(ModelRef(name="datapath", fingerprint="0" * 16, config={}), {},
                     KVGeometry(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32"), {})
            yield from sink.take()

        s.recv(1)  # the receiver is ready
        r0, t0, n = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
        for batch in _batches(frames()):
            n += sum(v.nbytes for v in batch)
            _send_all(s, batch)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
    out.put({"bytes": n, "seconds": t1 - t0,
             "cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime})


def _receive(tokens: int, split: list[int]) -> tuple[dict, dict]:
    """Run one round: (the sender's figures, the receiver's), the received KV checked against the source's."""
    import resource

    import torch
    from relayout.engine.moves.kv_stream import chunk_sink
    from relayout.storage.stores import MemoryStore
    from relayout.storage.stream import StreamReceiver

    blocks = list(range(tokens // 16 + 1))
    pools, lo = [], 0
    for w in split:
        pools.append((_pool(w, len(blocks)), (lo, lo + w)))
        lo += w

    class Engine:  # what chunk_sink reads of a target engine
        cfg = type("cfg", (), {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM})
        executor = type("executor", (), {"host_pools": staticmethod(lambda g, every_copy=False: pools)})

    with _connected(_send, tokens) as (conn, sent):
        placed: dict = {}
        recv = StreamReceiver(MemoryStore(), verify=False,
                              place=lambda ref, e: chunk_sink(Engine, {"s": (0, blocks)}, {}, placed, ref, e))
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        recv.receive_from(conn.recv_into)  # to the manifest (its import, an engine's, is not this bench's)
        r1, t1 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
    src = _pool(HEADS, len(blocks), seed=7)
    for layer in range(LAYERS):
        want = src.export_tokens(blocks, 0, tokens)[layer]
        for pool, (h0, h1) in pools:
            if not torch.equal(pool.export_tokens(blocks, 0, tokens)[layer], want[:, h0:h1]):
                raise RuntimeError(f"layer {layer}, heads [{h0}, {h1}): the received KV differs from the source's")
    got = {"bytes": recv.bytes_received, "seconds": t1 - t0, "chunks": recv.chunks_received,
           "placed_chunks": recv.chunks_placed,
           "cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime}
    return sent, got


def _floor_send(port: int, tokens: int, out: mp.Queue) -> None:
    """The floor's source: the same KV pool's bytes, each chunk's worth hashed (xxh3, as the path's
    chunks are) and then sent, in the path's 1 MiB sends; no framing, manifest or per-chunk Python."""
    import resource

    import numpy as np
    import xxhash
    from relayout.engine.moves.snapshot import CHUNK_TOKENS

    src = _pool(HEADS, tokens // 16 + 1, seed=7)
    chunk = 2 * CHUNK_TOKENS * HEADS * HEAD_DIM * 4  # a chunk's bytes (its K and V rows)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.recv(1)
        r0, n = resource.getrusage(resource.RUSAGE_SELF), 0
        for t in src.k + src.v:
            a = memoryview(t.numpy().view(np.uint8).reshape(-1))
            for o in range(0, len(a), chunk):
                piece = a[o : o + chunk]
                xxhash.xxh3_128(piece).digest()
                for b in range(0, len(piece), 1 << 20):
                    s.sendall(piece[b : b + (1 << 20)])
                n += len(piece)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
    out.put({"bytes": n, "cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime})


def floor_copy(tokens: int, split: list[int]) -> dict[str, float]:
    """CPU seconds per GB (`sender`, `receiver`) of the least work a verified move of these bytes
    into pools of `split` heads does, as plain Python and numpy: the source hashes and sends them
    (_floor_send); this end receives them 1 MiB at a time into a buffer that stays in L2, hashes it,
    and copies each token's row into the pools that hold its heads (the path's PoolRowSink, less
    framing and bookkeeping)."""
    import resource

    import numpy as np
    import xxhash

    row = HEADS * HEAD_DIM * 4
    rows = (1 << 20) // row
    # paged in, as a serving replica's pools are (np.zeros would fault each page in during the copy)
    pools = [np.full(((tokens // 16 + 1) * 16 * 2 * LAYERS, w * HEAD_DIM * 4), 1, np.uint8) for w in split]
    cols, lo = [], 0
    for w in split:
        cols.append(slice(lo * HEAD_DIM * 4, (lo + w) * HEAD_DIM * 4))
        lo += w
    bounce = np.empty((rows, row), np.uint8)
    flat = memoryview(bounce.reshape(-1))
    with _connected(_floor_send, tokens) as (conn, sent):
        r0, at, got, end = resource.getrusage(resource.RUSAGE_THREAD), 0, 0, False
        while not end:
            filled = 0
            while filled < len(flat):
                k = conn.recv_into(flat[filled:])
                if not k:
                    end = True
                    break
                filled += k
            n = filled // row
            xxhash.xxh3_128(flat[:filled]).digest()
            for pool, c in zip(pools, cols, strict=True):
                dst = pool[at % len(pool) :][:n]
                np.copyto(dst, bounce[: len(dst), c])
            at, got = at + n, got + filled
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
    gb = got / 1e9
    return {"sender": sent["cpu_s"] / gb, "receiver": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / gb}


def run(tokens: int = 4096, split: list[int] | None = None, reps: int = 3, log: Log = lambda s: None) -> dict:
    """Best of `reps` rounds of `tokens` of KV (64 KiB each) into pools of `split` heads (default two
    TP ranks of 4), and the bare copy of as many distinct bytes, alternating."""
    from relayout.bench.replica_client import link_copy

    split = split or [HEADS // 2, HEADS // 2]
    if sum(split) != HEADS or min(split) < 1:
        raise ValueError(f"split must be positive head counts adding up to {HEADS}")
    paths, bares, floors = [], [], []
    for i in range(reps):
        sent, got = _receive(tokens, split)
        bare = link_copy(got["bytes"], distinct=True)
        floors.append(floor_copy(tokens, split))
        gb = got["bytes"] / 1e9
        paths.append({"sender_cpu_s_per_gb": sent["cpu_s"] / gb, "receiver_cpu_s_per_gb": got["cpu_s"] / gb,
                      "gbps": gb / max(sent["seconds"], got["seconds"]), "placed_chunks": got["placed_chunks"],
                      "chunks": got["chunks"], "bytes": got["bytes"]})
        bares.append({"cpu_s_per_gb": bare.cpu_s_per_gb(got["bytes"]) or 0.0, "gbps": bare.gbps})
        log(f"rep {i + 1}: path {paths[-1]['gbps']:.2f} GB/s, CPU s/GB sender {paths[-1]['sender_cpu_s_per_gb']:.3f} "
            f"receiver {paths[-1]['receiver_cpu_s_per_gb']:.3f}; bare {bares[-1]['gbps']:.2f} GB/s, "
            f"{bares[-1]['cpu_s_per_gb']:.3f} CPU s/GB; floor sender {floors[-1]['sender']:.3f} receiver "
            f"{floors[-1]['receiver']:.3f}")
    best = min(paths, key=lambda p: p["sender_cpu_s_per_gb"] + p["receiver_cpu_s_per_gb"])
    bare = min(bares, key=lambda b: b["cpu_s_per_gb"])
    cpu = best["sender_cpu_s_per_gb"] + best["receiver_cpu_s_per_gb"]
    floor = min(floors, key=lambda f: f["sender"] + f["receiver"])
    floor_cpu = floor["sender"] + floor["receiver"]
    return {"tokens": tokens, "target_heads": split, "bytes": best["bytes"], "chunks": best["chunks"],
            "placed_chunks": best["placed_chunks"], "gbps": round(best["gbps"], 3),
            "sender_cpu_s_per_gb": round(best["sender_cpu_s_per_gb"], 3),
            "receiver_cpu_s_per_gb": round(best["receiver_cpu_s_per_gb"], 3), "cpu_s_per_gb": round(cpu, 3),
            "bare_gbps": round(bare["gbps"], 3), "bare_cpu_s_per_gb": round(bare["cpu_s_per_gb"], 3),
            "cpu_vs_bare": round(cpu / bare["cpu_s_per_gb"], 3) if bare["cpu_s_per_gb"] else None,
            # the floor (floor_copy): the bare copy plus the hash at each end and the copy into the pools
            "floor_sender_cpu_s_per_gb": round(floor["sender"], 3),
            "floor_receiver_cpu_s_per_gb": round(floor["receiver"], 3), "floor_cpu_s_per_gb": round(floor_cpu, 3),
            "floor_vs_bare": round(floor_cpu / bare["cpu_s_per_gb"], 3) if bare["cpu_s_per_gb"] else None,
            "cpu_vs_floor": round(cpu / floor_cpu, 3) if floor_cpu else None,
            "reps": {"path": paths, "bare": bares, "floor": floors}}
