"""KVStager on the CPU: bytes, stream/event ordering (recorded and deferred fakes), buffer reuse."""

from __future__ import annotations

import pytest
import torch
from relayout.engine.kv_cache import KVCache
from relayout.engine.ranks.staging import MIN_CLASS, KVStager, size_class, token_slots
from relayout.engine.ranks.stream_ops import HostEvent, HostOps, StreamOps

L, NB, H, D, BS = 3, 24, 2, 8, 16


def make_kv(dtype=torch.float32, seed=0) -> KVCache:
    kv = KVCache(L, NB, H, D, dtype, torch.device("cpu"), block_size=BS)
    g = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return kv


BLOCKS = [7, 2, 19, 0, 11]  # scattered, out of order


# ---- fakes ----------------------------------------------------------------------------------------
class RecordingOps(HostOps):
    """Runs everything at once (like the CPU) and logs every stream/event call in order."""

    def __init__(self):
        self.log: list[tuple] = []
        self._n = 0

    def compute_stream(self):
        return "compute"

    def new_stream(self):
        self._n += 1
        return f"s{self._n}"

    def new_event(self):
        return HostEvent()

    def record(self, ev, stream):
        self.log.append(("record", ev, stream))
        ev.done = True

    def wait(self, stream, ev):
        self.log.append(("wait", stream, ev))

    def launch(self, stream, fn):
        self.log.append(("launch", stream))
        fn()

    def synchronize(self, ev):
        self.log.append(("sync", ev))


class FakeEvent:
    def __init__(self):
        self.done = False


class FakeStream:
    def __init__(self, name):
        self.name, self.q = name, []


class DeferredOps(StreamOps):
    """Device-like: work queues per stream and runs only when the test (or a host sync) drives it;
    a stream stops at a wait on an event not yet reached."""

    def __init__(self):
        self.compute = FakeStream("compute")
        self.streams = [self.compute]

    def compute_stream(self):
        return self.compute

    def new_stream(self):
        s = FakeStream(f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def new_event(self):
        return FakeEvent()

    def record(self, ev, stream):
        ev.done = False
        stream.q.append(("record", ev))

    def wait(self, stream, ev):
        stream.q.append(("wait", ev))

    def launch(self, stream, fn):
        stream.q.append(("fn", fn))

    def query(self, ev):
        return ev.done

    def run(self, stream) -> bool:
        """Run `stream` until empty or blocked; True if anything ran."""
        ran = False
        while stream.q:
            op, x = stream.q[0]
            if op == "wait" and not x.done:
                break
            stream.q.pop(0)
            ran = True
            if op == "fn":
                x()
            elif op == "record":
                x.done = True
        return ran

    def synchronize(self, ev):
        while not ev.done:
            if not any(self.run(s) for s in self.streams):
                raise AssertionError("deadlock: the event can never complete")

    def pending(self, stream) -> int:
        return len(stream.q)


# ---- bytes ----------------------------------------------------------------------------------------
def test_size_class():
    assert size_class(0) == MIN_CLASS and size_class(1) == MIN_CLASS
    assert size_class(MIN_CLASS) == MIN_CLASS and size_class(MIN_CLASS + 1) == 2 * MIN_CLASS
    assert size_class(3 << 20) == 4 << 20


def test_token_slots():
    s = token_slots([5, 1], 14, 18, 16)
    assert s.tolist() == [5 * 16 + 14, 5 * 16 + 15, 16, 17]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lo,hi", [(0, 80), (0, 1), (5, 37), (16, 32), (31, 33), (79, 80)])
def test_export_equals_cache(dtype, lo, hi):
    kv = make_kv(dtype)
    st = KVStager("cpu", max_bytes=1 << 24)
    h = st.export(kv, BLOCKS, lo, hi)
    assert h.ready()
    got = h.wait()
    want = kv.export_tokens(BLOCKS, lo, hi)
    assert got.shape == want.shape == (L, 2, H, hi - lo, D) and got.dtype == dtype
    assert torch.equal(got, want)
    h.release()


def test_small_chunks_same_bytes():
    kv = make_kv()
    st = KVStager("cpu", max_bytes=1 << 24, chunk_bytes=100)  # many partial copies per layer
    assert torch.equal(st.export(kv, BLOCKS, 3, 77).wait(), kv.export_tokens(BLOCKS, 3, 77))
    src = torch.randn(L, 2, H, 30, D)
    st.import_(kv, BLOCKS, 9, src)
    assert torch.equal(kv.export_tokens(BLOCKS, 9, 39), src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_equals_import_tokens(dtype):
    src = torch.randn(L, 2, H, 45, D)
    a, b = make_kv(dtype, 1), make_kv(dtype, 1)
    st = KVStager("cpu", max_bytes=1 << 24)
    h = st.import_(a, BLOCKS, 17, src)
    h.wait()
    assert h.ready()
    b.import_tokens(BLOCKS, 17, src)
    for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(st.export(a, BLOCKS, 17, 62).wait(), src.to(dtype))
    with pytest.raises(ValueError):
        st.import_(a, BLOCKS, 0, torch.zeros(L, 2, H + 1, 4, D))


# ---- ordering -------------------------------------------------------------------------------------
def _idx(log, pred):
    return next(i for i, e in enumerate(log) if pred(e))


def test_export_ordering_recorded():
    ops = RecordingOps()
    st = KVStager("cpu", max_bytes=1 << 24, ops=ops)
    kv = make_kv()
    ops.log.clear()
    h = st.export(kv, BLOCKS, 0, 40)
    log = ops.log
    cs = st.copy_stream
    assert cs != "compute"
    boundary = log[0][1]
    # the boundary event is captured on the compute stream, the copy stream waits on it, then copies
    assert log[0] == ("record", boundary, "compute")
    i_wait = _idx(log, lambda e: e[0] == "wait" and e[1] == cs and e[2] is boundary)
    i_launch = _idx(log, lambda e: e == ("launch", cs))
    i_done = _idx(log, lambda e: e[0] == "record" and e[1] is h.done and e[2] == cs)
    assert 0 < i_wait < i_launch < i_done
    # the host never blocks in export(), and nothing makes the compute stream wait on the export
    assert not any(e[0] == "sync" for e in log)
    assert not any(e[0] == "wait" and e[1] == "compute" for e in log)
    assert not any(e[0] == "launch" and e[1] == "compute" for e in log)
    h.wait()
    assert log[-1] == ("sync", h.done)


def test_import_ordering_recorded():
    ops = RecordingOps()
    st = KVStager("cpu", max_bytes=1 << 24, ops=ops)
    kv = make_kv()
    ops.log.clear()
    h = st.import_(kv, BLOCKS, 0, torch.randn(L, 2, H, 20, D))
    log = ops.log
    ss = st.side_stream
    assert ss not in ("compute", st.copy_stream)
    boundary = log[0][1]
    assert log[0] == ("record", boundary, "compute")
    i_wait = _idx(log, lambda e: e[0] == "wait" and e[1] == ss and e[2] is boundary)
    i_launch = _idx(log, lambda e: e == ("launch", ss))
    i_done = _idx(log, lambda e: e[0] == "record" and e[1] is h.done and e[2] == ss)
    i_compute_waits = _idx(log, lambda e: e[0] == "wait" and e[1] == "compute" and e[2] is h.done)
    assert 0 < i_wait < i_launch < i_done < i_compute_waits
    assert not any(e[0] == "sync" for e in log)  # the host is not blocked


def test_decode_continues_while_export_drains():
    """Deferred streams: the export's copies run after later decode steps wrote other slots (and
    later slots of the last block); the exported bytes are still the cache at the boundary."""
    ops = DeferredOps()
    st = KVStager("cpu", max_bytes=1 << 24, ops=ops)
    kv = make_kv()
    n = 37  # ends inside block BLOCKS[2]
    # a step enqueued before the boundary writes token 36: the export must see it
    new36 = torch.randn(L, 2, H, D)

    def step_writes(pos, vals):
        slot = token_slots(BLOCKS, pos, pos + 1, BS)
        for layer in range(L):
            kv.write(layer, slot, vals[layer, 0][None], vals[layer, 1][None])

    ops.launch(ops.compute, lambda: step_writes(36, new36))
    h = st.export(kv, BLOCKS, 0, n)
    assert not h.ready()
    # the copy stream is blocked behind the boundary event until the compute stream reaches it
    assert not ops.run(st.copy_stream)
    ops.run(ops.compute)  # step 36 done, boundary reached
    want = kv.export_tokens(BLOCKS, 0, n).clone()
    assert torch.equal(want[:, :, :, 36], new36)
    # decode goes on: tokens 37..40 (same last block) and another session's blocks are written
    for pos in range(37, 41):
        ops.launch(ops.compute, lambda p=pos: step_writes(p, torch.randn(L, 2, H, D)))
    other = [3, 4]
    ops.launch(ops.compute, lambda: [t[other].normal_() for t in kv.k + kv.v])
    ops.run(ops.compute)
    assert not h.ready()  # the export has not run a single copy yet
    got = h.wait()  # drives the copy stream
    assert h.ready()
    assert torch.equal(got, want)


def test_import_orders_next_step():
    """Deferred streams: the compute stream's next step waits for the import; the import waits
    for steps enqueued before it."""
    ops = DeferredOps()
    st = KVStager("cpu", max_bytes=1 << 24, ops=ops)
    kv = make_kv()
    src = torch.randn(L, 2, H, 20, D)
    seen = []
    ops.launch(ops.compute, lambda: seen.append(("before", kv.export_tokens(BLOCKS, 0, 20).clone())))
    h = st.import_(kv, BLOCKS, 0, src)
    ops.launch(ops.compute, lambda: seen.append(("after", kv.export_tokens(BLOCKS, 0, 20).clone())))
    src.zero_()  # the caller may reuse its tensor at once: the stager copied it into staging
    assert not ops.run(st.side_stream)  # blocked until the compute stream passes the boundary
    ops.run(ops.compute)  # runs "before", records the boundary, then stops at the wait on the import
    assert [s for s, _ in seen] == ["before"] and ops.pending(ops.compute) > 0
    ops.run(st.side_stream)
    assert h.ready()
    ops.run(ops.compute)
    assert [s for s, _ in seen] == ["before", "after"]
    assert not torch.equal(seen[0][1], seen[1][1])
    assert torch.equal(seen[1][1], st.export(kv, BLOCKS, 0, 20).wait())


# ---- buffer reuse ---------------------------------------------------------------------------------
def test_no_allocation_per_snapshot_after_warmup():
    st = KVStager("cpu", max_bytes=1 << 24)
    kv = make_kv()
    st.export(kv, BLOCKS, 0, 70).release()
    st.import_(kv, BLOCKS, 0, torch.randn(L, 2, H, 70, D))
    warm = st.allocations
    assert warm > 0
    for i in range(20):
        h = st.export(kv, BLOCKS, 0, 65 + i % 6)  # same size classes as the warm-up's
        assert torch.equal(h.wait(), kv.export_tokens(BLOCKS, 0, 65 + i % 6))
        h.release()
        st.import_(kv, BLOCKS, 0, torch.randn(L, 2, H, 70, D))
    assert st.allocations == warm
    # the runner's way: nobody calls release(), the caller just drops the tensor
    for _ in range(5):
        t = st.export(kv, BLOCKS, 0, 70).wait()
        assert t.sum().item() != 0
        del t
    assert st.allocations == warm


def test_held_results_are_never_overwritten():
    st = KVStager("cpu", max_bytes=1 << 24)
    kv = make_kv()
    a = st.export(kv, BLOCKS, 0, 40).wait()
    part = a[1, :, :, 3:9]  # a view outliving the base tensor keeps the buffer too
    keep_part = part.clone()
    del a
    n0 = st.host_pool.allocations
    for t in kv.k + kv.v:
        t.normal_()
    b = st.export(kv, BLOCKS, 0, 40).wait()
    assert st.host_pool.allocations == n0 + 1  # a second buffer: the first is still in use
    assert torch.equal(part, keep_part)
    assert b.data_ptr() != part.data_ptr()
    del part, b
    st.export(kv, BLOCKS, 0, 40).release()
    assert st.host_pool.allocations == n0 + 1


def test_shared_buffers_leave_the_pool():
    """A result sent to another process (torch.multiprocessing moves it into shared memory in
    place) must never be written again by this process."""
    st = KVStager("cpu", max_bytes=1 << 24)
    kv = make_kv()
    t = st.export(kv, BLOCKS, 0, 40).wait()
    t.share_memory_()  # what conn.send does to it on its way to the driver process
    ptr = t.data_ptr()
    n0, pooled = st.host_pool.allocations, st.host_pool.pooled_bytes
    del t  # gone here; the receiver still maps that memory
    u = st.export(kv, BLOCKS, 0, 40).wait()
    assert u.data_ptr() != ptr
    # the shared buffer left the pool, a fresh one took its place
    assert st.host_pool.allocations == n0 + 1 and st.host_pool.pooled_bytes == pooled


def test_pool_cap_waits_for_inflight_buffers_then_overflows():
    ops = DeferredOps()
    size = L * 2 * H * 16 * D * 4
    st = KVStager("cpu", max_bytes=size_class(size), ops=ops)
    kv = make_kv()
    h1 = st.export(kv, BLOCKS, 0, 16)
    h1.release()  # released while its copy is still queued
    assert not h1.ready()
    h2 = st.export(kv, BLOCKS, 16, 32)  # pool full: waits for h1's copy, then reuses its buffer
    assert h1.ready() and st.host_pool.allocations == 1 and st.host_pool.overflow == 0
    h3 = st.export(kv, BLOCKS, 32, 48)  # h2 is held: a one-off buffer, not kept
    assert st.host_pool.overflow == 1 and st.host_pool.allocations == 1
    assert torch.equal(h3.wait(), kv.export_tokens(BLOCKS, 32, 48))
    assert torch.equal(h2.wait(), kv.export_tokens(BLOCKS, 16, 32))


# ---- wiring ---------------------------------------------------------------------------------------
def test_runner_uses_stager_only_on_cuda_and_both_paths_agree():
    from relayout.engine.moves.snapshot import take_snapshot
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams

    eng = LLMEngine("builtin:tiny", device="cpu", kv_cache_bytes=4 << 20)
    try:
        runner = eng.executor.runner
        assert runner.stager is None  # CPU behaviour unchanged
        s = eng.add_session(list(range(40, 90)), SamplingParams(max_tokens=4, ignore_eos=True))
        while not eng.sessions[s.session_id].output_token_ids:
            eng.step()
        plain = take_snapshot(eng, [s.session_id])[0].kv
        runner.stager = KVStager("cpu", max_bytes=1 << 24)  # the CUDA path, run on the host
        staged = take_snapshot(eng, [s.session_id])[0].kv
        assert [(lo, hi) for lo, hi, _ in plain] == [(lo, hi) for lo, hi, _ in staged]
        for (_, _, a), (_, _, b) in zip(plain, staged, strict=True):
            assert torch.equal(a, b)
        table = eng.scheduler.tables[s.session_id]
        n = eng.sessions[s.session_id].num_computed
        kv = staged[0][2].clone()
        runner.import_kv(table.blocks, 0, torch.zeros_like(kv))
        assert runner.kv.export_tokens(table.blocks, 0, n).abs().sum() == 0
        runner.import_kv(table.blocks, 0, kv)
        assert torch.equal(runner.export_kv(table.blocks, 0, n), kv)
    finally:
        eng.shutdown()
