"""`relayout bench snapshot`: GB/s to snapshot and restore session KV vs a plain memory copy.

One process, one run: prefill a few sessions on a world-1 engine, then time
- memcpy: `copy_` of the same number of bytes into a preallocated buffer (the ceiling);
- snapshot: take_snapshot + write_snapshot + commit into a MemoryStore, codec "none"
  (copy out of the KV pool, safetensors pack, xxh3 hash) — the full path, fresh store per try;
- restore: restore() of that checkpoint into a second engine, chunk verification included.
Each figure is the best of `reps` (on a shared machine the fastest try is the least disturbed).
Codec ratios and per-core speeds are measured on (up to 32 MiB of) the prefilled KV, chunk by chunk as a
checkpoint stores it, in float32 and rounded to bf16.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from relayout.engine.config import ModelConfig
from relayout.engine.engine import LLMEngine
from relayout.engine.session import SamplingParams
from relayout.engine.snapshot import (
    CHUNK_TOKENS,
    checkpoint,
    geometry,
    model_ref,
    new_checkpoint_id,
    release,
    restore,
    take_snapshot,
    write_snapshot,
)
from relayout.engine.weights import resolve_model
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.codecs import CODECS, measure_codecs
from relayout.storage.stores import MemoryStore

CODEC_SAMPLE_BYTES = 32 * 2**20  # zstd at ~0.3-1 GB/s on 2 cores: a sample keeps the bench short


def _best(fn: Callable[[], float], reps: int) -> float:
    return min(fn() for _ in range(reps))


def _memcpy_s(nbytes: int, reps: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first: we want the copy, not the allocator

    def once() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    return _best(once, reps)


def _fill(eng: LLMEngine, sessions: int, tokens: int, prefill: int) -> tuple[list[str], list[torch.Tensor]]:
    """`sessions` live sessions of `tokens` tokens of KV each.

    Prefilling 8k+ tokens of builtin:bench takes minutes on 2 shared cores, so each session
    prefills `prefill` real tokens (not a divisor of the chunk size, so chunks stay distinct) and is grown to `tokens` by restoring it (through the
    public checkpoint path) with that real KV tiled along the tokens: real values for the
    codecs, the exact sizes and block layout for the copies. Also returns the prefilled (untiled)
    KV as the chunks a checkpoint of it holds (one per session, layer and head range): codecs are
    measured on those, as tiles would flatter zstd."""
    g = torch.Generator().manual_seed(0)
    seeds = []
    for i in range(sessions):
        prompt = torch.randint(32, 127, (min(prefill, tokens),), generator=g).tolist()
        seeds.append(eng.add_session(prompt, SamplingParams(max_tokens=8, ignore_eos=True), f"seed-{i}").session_id)
    while any(not eng.sessions[s].output_token_ids for s in seeds):  # prefill done once each has sampled
        eng.step()
    snaps = take_snapshot(eng, seeds)
    real = [t[layer, :, :, a : a + CHUNK_TOKENS].contiguous()
            for sn in snaps for _, _, t in sn.kv for layer in range(t.shape[0]) for a in range(0, t.shape[3], CHUNK_TOKENS)]
    release(eng, seeds)
    store = MemoryStore()
    w = CheckpointWriter(store, new_checkpoint_id())
    for i, sn in enumerate(snaps):
        reps = -(-tokens // sn.num_kv_tokens)
        st = sn.state
        st.session_id, st.prompt_token_ids = f"snap-{i}", (st.prompt_token_ids * reps)[:tokens]
        st.num_computed = sn.num_kv_tokens = tokens
        sn.kv = [(lo, hi, t.repeat(1, 1, 1, reps, 1)[:, :, :, :tokens].contiguous()) for lo, hi, t in sn.kv]
    write_snapshot(snaps, w)
    w.commit(model_ref(eng), eng.layout.to_dict(), geometry(eng), {})
    return restore(eng, CheckpointReader(store, w.checkpoint_id)), real


def _codecs(chunks: list[torch.Tensor], reps: int) -> dict[str, dict[str, float]]:
    raw = [t.view(torch.uint8).numpy().tobytes() for t in chunks]
    res = measure_codecs(raw, chunks[0].element_size(), reps)  # one thread: per-core figures
    return {k: {m: round(x, 3) for m, x in v.items()} for k, v in res.items()}


def _sig(x: float) -> float:
    """x to 4 significant digits (a fixed number of decimals rounds a tiny model's GB/s to 0)."""
    return float(f"{x:.4g}")


def run(model: str = "builtin:bench", sessions: int = 4, tokens: int = 2048, prefill: int = 200, reps: int = 3,
        quick: bool = False, log: Callable[[str], None] = print) -> dict:
    if quick:  # smoke-test size: a few seconds end to end
        sessions, tokens, prefill, reps = 2, 64, 24, 1
    total_tokens = sessions * tokens
    log(f"loading {model} twice (source and restore target)…")
    cfg = ModelConfig.from_dir(resolve_model(model))
    per_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32, all KV heads
    kv_bytes = total_tokens * per_tok
    room = int(kv_bytes * 1.25) + 64 * per_tok * sessions  # block rounding + a few decode tokens each
    src = LLMEngine(model, kv_cache_bytes=room, max_prefill_tokens=max(512, tokens))
    dst = LLMEngine(model, kv_cache_bytes=room, max_prefill_tokens=max(512, tokens))
    res: dict = {"model": model, "sessions": sessions, "tokens_per_session": tokens, "prefilled_per_session": prefill,
                 "kv_bytes": kv_bytes,
                 "threads": torch.get_num_threads(), "reps": reps}
    try:
        log(f"filling {sessions} sessions × {tokens} tokens ({kv_bytes / 2**20:.0f} MiB of KV; {prefill} prefilled each)…")
        ids, real = _fill(src, sessions, tokens, prefill)
        _ = src.fingerprint, dst.fingerprint  # hashes the weights once: not part of a snapshot's cost
        ids_kv = sum(src.sessions[s].num_computed for s in ids) * per_tok
        log("memcpy…")
        t_mem = _memcpy_s(ids_kv, reps)
        log("snapshot…")
        store = MemoryStore()
        ckpt_ids: list[str] = []

        def snap_once() -> float:
            nonlocal store
            store = MemoryStore()  # fresh: no chunk dedup against an earlier try
            w = CheckpointWriter(store, new_checkpoint_id(), codec="none")
            t = time.perf_counter()
            checkpoint(src, w, ids)
            dt = time.perf_counter() - t
            ckpt_ids.append(w.checkpoint_id)
            return dt

        t_snap = _best(snap_once, reps)
        log("restore…")

        def restore_once() -> float:
            r = CheckpointReader(store, ckpt_ids[-1])
            t = time.perf_counter()
            got = restore(dst, r, verify=True)
            dt = time.perf_counter() - t
            release(dst, got)  # free the blocks for the next try
            return dt

        t_rest = _best(restore_once, reps)
        gb = ids_kv / 1e9
        res.update(kv_bytes=ids_kv, memcpy_gbps=_sig(gb / t_mem), snapshot_gbps=_sig(gb / t_snap),
                   restore_gbps=_sig(gb / t_rest))
        res["snapshot_vs_memcpy"] = _sig(t_mem / t_snap)
        res["restore_vs_memcpy"] = _sig(t_mem / t_rest)
        log("codecs…")
        sample, res["codec_sample_bytes"] = [], 0
        for t in real:  # whole chunks, up to CODEC_SAMPLE_BYTES
            if res["codec_sample_bytes"] < CODEC_SAMPLE_BYTES:
                sample.append(t)
                res["codec_sample_bytes"] += t.nbytes
        res["codec_chunks"] = len(sample)
        res["codecs"] = _codecs(sample, reps)
        res["codecs_bf16"] = _codecs([t.to(torch.bfloat16) for t in sample], reps)  # a bf16 engine's KV
    finally:
        src.shutdown()
        dst.shutdown()
    return res


def print_table(res: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"KV snapshot/restore — {res['model']}, {res['sessions']} sessions × "
                    f"{res['tokens_per_session']} tokens = {res['kv_bytes'] / 2**20:.0f} MiB, "
                    f"{res['threads']} threads, best of {res['reps']}")
    for col in ("path", "GB/s", "vs memcpy"):
        t.add_column(col, justify="right")
    t.add_row("memcpy (torch copy_)", f"{res['memcpy_gbps']:.2f}", "1.00x")
    t.add_row("snapshot (codec none)", f"{res['snapshot_gbps']:.2f}", f"{res['snapshot_vs_memcpy']:.2f}x")
    t.add_row("restore (verify incl.)", f"{res['restore_gbps']:.2f}", f"{res['restore_vs_memcpy']:.2f}x")
    console.print(t)
    c = Table(title=f"codecs on {res['codec_sample_bytes'] / 2**20:.0f} MiB of this KV in {res['codec_chunks']} "
                    "chunks (GB/s per core: encode+decode, encode, decode)")
    for col in ("codec", "ratio fp32", "GB/s fp32", "enc / dec fp32", "ratio bf16", "GB/s bf16", "enc / dec bf16"):
        c.add_column(col, justify="right")
    for name in CODECS:
        a, b = res["codecs"][name], res["codecs_bf16"][name]
        c.add_row(name, f"{a['ratio']:.3f}", f"{a['gbps']:.2f}", f"{a['encode_gbps']:.2f} / {a['decode_gbps']:.2f}",
                  f"{b['ratio']:.3f}", f"{b['gbps']:.2f}", f"{b['encode_gbps']:.2f} / {b['decode_gbps']:.2f}")
    console.print(c)
