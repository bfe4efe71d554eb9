"""GPU checks of the KV stager (engine/ranks/staging.py); skipped without CUDA.

deploy/gpu/run_gpu_checks.sh runs these on a CUDA machine (`pytest -m cuda`). Figures go to
stdout and, when RELAYOUT_GPU_RESULTS names a file, one JSON line per test into it.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = torch.device("cuda")


def report(name: str, **figures) -> None:
    line = json.dumps({"test": name, **figures})
    print(line)
    path = os.environ.get("RELAYOUT_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def make_kv(layers=4, blocks=256, heads=4, dim=64, dtype=torch.float32, seed=0):
    from relayout.engine.kv_cache import KVCache

    kv = KVCache(layers, blocks, heads, dim, dtype, DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g, device=DEV).to(dtype))
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_import_bit_exact(dtype):
    from relayout.engine.ranks.staging import KVStager

    kv = make_kv(dtype=dtype)
    st = KVStager(DEV, max_bytes=1 << 28, chunk_bytes=1 << 16)  # small chunks: many copies per layer
    blocks = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:40].tolist()
    for lo, hi in [(0, 640), (3, 7), (15, 17), (100, 613)]:
        h = st.export(kv, blocks, lo, hi)
        got = h.wait()
        assert h.ready() and got.is_pinned() and got.device.type == "cpu"
        assert torch.equal(got, kv.export_tokens(blocks, lo, hi).cpu())
        h.release()
    # import into a second cache: identical to KVCache.import_tokens, and visible to the next kernel
    src = torch.randn(4, 2, 4, 300, 64).to(dtype)
    a, b = make_kv(dtype=dtype, seed=2), make_kv(dtype=dtype, seed=2)
    st.import_(a, blocks, 21, src)  # no host sync: the compute stream waits for it
    b.import_tokens(blocks, 21, src)
    for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
        assert torch.equal(x, y)
    n0 = st.allocations
    for _ in range(5):
        st.export(kv, blocks, 0, 640).release()
        st.import_(a, blocks, 21, src)
    torch.cuda.synchronize()
    assert st.allocations == n0  # no allocation per snapshot after warm-up


def test_runner_snapshot_restore_roundtrip_on_cuda():
    """The engine's own path (ModelRunner.export_kv/import_kv through the stager): a checkpoint
    restored into a second replica continues with the same tokens."""
    from relayout.engine.moves.placer import restore
    from relayout.engine.moves.snapshot import checkpoint, new_checkpoint_id
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams
    from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
    from relayout.storage.stores import MemoryStore

    a = LLMEngine("builtin:tiny", device="cuda", kv_cache_bytes=64 << 20)
    b = LLMEngine("builtin:tiny", device="cuda", kv_cache_bytes=64 << 20)
    ref = LLMEngine("builtin:tiny", device="cuda", kv_cache_bytes=64 << 20)
    try:
        assert a.executor.runner.stager is not None
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        prompt = list(range(40, 140))
        s = a.add_session(prompt, params)
        r = ref.add_session(prompt, params)
        for _ in range(8):
            a.step()
        store = MemoryStore()
        w = CheckpointWriter(store, new_checkpoint_id())
        checkpoint(a, w, [s.session_id])
        got = restore(b, CheckpointReader(store, w.checkpoint_id))
        assert got == [s.session_id]
        while not b.sessions[s.session_id].is_finished:
            b.step()
        while not ref.sessions[r.session_id].is_finished:
            ref.step()
        assert b.sessions[s.session_id].output_token_ids == ref.sessions[r.session_id].output_token_ids
    finally:
        for e in (a, b, ref):
            e.shutdown()


def _gbps(nbytes: int, fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def test_d2h_gbps_stager_vs_raw_pinned_copy():
    """Stager export (gather + D2H into pinned staging, waited for) vs a raw pinned `copy_` of
    the same bytes from one contiguous device tensor; the old path (index + .cpu()) for contrast."""
    from relayout.engine.ranks.staging import KVStager

    layers, heads, dim = 8, 8, 128  # builtin:bench's KV geometry: 64 KiB per token in float32
    tokens = 16384  # 1 GiB
    kv = make_kv(layers=layers, blocks=tokens // 16 + 8, heads=heads, dim=dim)
    blocks = list(range(tokens // 16))
    nbytes = 2 * layers * heads * tokens * dim * 4
    st = KVStager(DEV, max_bytes=2 << 30)
    src = torch.randn(nbytes // 4, device=DEV)
    dst = torch.empty(nbytes // 4, pin_memory=True)
    up = torch.empty_like(src)

    def raw_d2h():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    def raw_h2d():
        up.copy_(dst, non_blocking=True)
        torch.cuda.synchronize()

    def staged_export():
        h = st.export(kv, blocks, 0, tokens)
        h.wait()
        h.release()

    host = torch.randn(layers, 2, heads, tokens, dim)

    def staged_import():
        st.import_(kv, blocks, 0, host).wait()

    def old_export():
        kv.export_tokens(blocks, 0, tokens).cpu()

    raw = _gbps(nbytes, raw_d2h)
    staged = _gbps(nbytes, staged_export)
    allocs_host = st.host_pool.allocations
    old = _gbps(nbytes, old_export, reps=2)
    raw_up = _gbps(nbytes, raw_h2d)
    staged_up = _gbps(nbytes, staged_import)
    staged_again = _gbps(nbytes, staged_export)
    assert st.host_pool.allocations == allocs_host  # the exports after warm-up allocated nothing
    report("d2h_gbps", bytes=nbytes, raw_pinned_d2h_gbps=round(raw, 2), stager_d2h_gbps=round(staged, 2),
           stager_d2h_gbps_again=round(staged_again, 2), stager_vs_raw=round(max(staged, staged_again) / raw, 3),
           old_path_d2h_gbps=round(old, 2), raw_pinned_h2d_gbps=round(raw_up, 2),
           stager_h2d_gbps=round(staged_up, 2), stager_h2d_vs_raw=round(staged_up / raw_up, 3),
           note="stager_h2d includes the host copy into pinned staging")
    assert max(staged, staged_again) > 0.5 * raw, "the stager's D2H should run near a raw pinned copy"


def test_decode_continues_while_snapshot_drains():
    """Decode steps on the compute stream while a 2 GiB export drains on the copy stream: steps
    complete before the export does, and their time is compared with steps without one."""
    from relayout.engine.ranks.staging import KVStager
    from relayout.engine.runtime.engine import LLMEngine
    from relayout.engine.runtime.session import SamplingParams

    eng = LLMEngine("builtin:bench", device="cuda", kv_cache_bytes=3 << 30)
    try:
        runner = eng.executor.runner
        for i in range(8):
            eng.add_session([40 + (i * 7 + j) % 80 for j in range(64)], SamplingParams(max_tokens=2000, ignore_eos=True))
        for _ in range(4):  # prefill and a few decode steps
            eng.step()
        torch.cuda.synchronize()
        # a big "session" the decode batch never touches: blocks reserved from the allocator
        tokens = 32768  # 2 GiB of float32 KV for builtin:bench
        blocks = eng.allocators[0].allocate(tokens // 16)
        slots = torch.tensor(blocks, device=DEV)
        for t in runner.kv.k + runner.kv.v:
            t[slots] = torch.randn((len(blocks), *t.shape[1:]), device=DEV)
        torch.cuda.synchronize()
        st = KVStager(DEV, max_bytes=4 << 30)
        st.export(runner.kv, blocks, 0, tokens).release()  # warm the pools
        torch.cuda.synchronize()

        def step_ms(n):
            out = []
            for _ in range(n):
                t = time.perf_counter()
                eng.step()  # ends in a .cpu() of the logits: a host sync with the compute stream
                out.append((time.perf_counter() - t) * 1e3)
            return out

        base = step_ms(20)
        t0 = time.perf_counter()
        h = st.export(runner.kv, blocks, 0, tokens)
        during, after = [], []
        drain_ms = None  # when the host first saw the export complete (polled between steps)
        while len(during) + len(after) < 20:
            if drain_ms is None and h.ready():
                drain_ms = (time.perf_counter() - t0) * 1e3
            (during if drain_ms is None else after).extend(step_ms(1))
        got = h.wait()
        if drain_ms is None:
            drain_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        st.export(runner.kv, blocks, 0, tokens).wait()
        alone_ms = (time.perf_counter() - t1) * 1e3
        # a synchronous snapshot (what the host sees if it waits): decode is stopped for its length
        assert torch.equal(got[:, :, :, :4096], runner.kv.export_tokens(blocks, 0, 4096).cpu())
        med = statistics.median
        report("decode_during_drain", export_bytes=got.numel() * 4, steps_while_draining=len(during),
               base_step_ms=round(med(base), 3), step_ms_while_draining=round(med(during), 3) if during else None,
               step_ratio=round(med(during) / med(base), 3) if during else None, drain_ms=round(drain_ms, 1),
               export_alone_ms=round(alone_ms, 1))
        assert during, "no decode step completed while the export drained"
        assert med(during) < 3 * med(base)
    finally:
        eng.shutdown()
