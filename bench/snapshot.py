"""`relayout bench snapshot`: GB/s to snapshot and restore session KV vs a plain memory copy.

One process, one run: prefill a few sessions on a world-1 engine, then time
- memcpy: `copy_` of the same number of bytes into a preallocated buffer (the ceiling);
- snapshot: take_snapshot + write_snapshot + commit into a MemoryStore, codec "none"
  (copy out of the KV pool, safetensors pack, xxh3 hash) — the full path, fresh store per try;
- restore: restore() of that checkpoint into a second engine, chunk verification included.
Each figure is the best of `reps` (on a shared machine the fastest try is the least disturbed).
Codec ratios and per-core speeds are measured on (up to 32 MiB of) the prefilled KV, chunk by chunk as a
checkpoint stores it (the stored payload: token-major, fp8 with its float32 scales), once per KV dtype: the
same prompts prefilled by an engine in float32, one in bfloat16 and one in bfloat16 with fp8_e4m3 KV,
so each figure is of the KV that dtype's engine computes, not of float32 values cast.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.weights import resolve_model
from relayout.engine.moves.placer import restore
from relayout.engine.moves.snapshot import (
    CHUNK_TOKENS,
    SessionSnapshot,
    checkpoint,
    geometry,
    model_ref,
    new_checkpoint_id,
    take_snapshot,
    write_snapshot,
)
from relayout.engine.runtime.engine import LLMEngine
from relayout.engine.runtime.session import SamplingParams
from relayout.storage.checkpoint import CheckpointReader, CheckpointWriter
from relayout.storage.format.chunks import pack_kv
from relayout.storage.format.codecs import CODECS, measure_codecs
from relayout.storage.stores import MemoryStore

CODEC_SAMPLE_BYTES = 32 * 2**20  # zstd at ~0.3-1 GB/s on 2 cores: a sample keeps the bench short
# zstd's own multi-threaded mode works on inputs of several MiB: the sample's chunks joined into such
MT_THREADS, MT_CHUNK_BYTES = 2, 8 * 2**20
# the KV dtypes whose codec figures are reported: name -> (engine dtype, engine kv_dtype)
KV_DTYPES: dict[str, tuple[str, str]] = {"float32": ("float32", "auto"), "bfloat16": ("bfloat16", "auto"),
                                         "fp8_e4m3": ("bfloat16", "fp8_e4m3")}


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


def _prompts(sessions: int, tokens: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(32, 127, (tokens,), generator=g).tolist() for _ in range(sessions)]


def _prefill(eng: LLMEngine, prompts: list[list[int]]) -> tuple[list[str], list[SessionSnapshot], list[bytes]]:
    """Prefill `prompts` on `eng`; their ids, snapshots and the payloads a checkpoint of them stores
    (codec "none": what a codec compresses), one per session, layer, head range and CHUNK_TOKENS."""
    seeds = [eng.add_session(p, SamplingParams(max_tokens=8, ignore_eos=True), f"seed-{i}").session_id
             for i, p in enumerate(prompts)]
    while any(not eng.sessions[s].output_token_ids for s in seeds):  # prefill done once each has sampled
        eng.step()
    snaps = take_snapshot(eng, seeds)
    payloads = []
    for sn in snaps:
        if sn.chunks is not None:  # a host pool's snapshot: already the stored chunks (fp8: with scales)
            payloads += [bytes(pack_kv(c[5], "none", c[6] if len(c) > 6 else None)[0]) for c in sn.chunks]
        else:
            payloads += [bytes(pack_kv(t[layer, :, :, a : a + CHUNK_TOKENS], "none")[0]) for _, _, t in sn.kv
                         for a in range(0, t.shape[3], CHUNK_TOKENS) for layer in range(t.shape[0])]
    return seeds, snaps, payloads


def _fill(eng: LLMEngine, sessions: int, tokens: int, prefill: int) -> tuple[list[str], list[bytes]]:
    """`sessions` live sessions of `tokens` tokens of KV each.

    Prefilling 8k+ tokens of builtin:bench takes minutes on 2 shared cores, so each session
    prefills `prefill` real tokens (not a divisor of the chunk size, so chunks stay distinct) and is grown to `tokens` by restoring it (through the
    public checkpoint path) with that real KV tiled along the tokens: real values for the
    codecs, the exact sizes and block layout for the copies. Also returns the prefilled (untiled)
    KV as the stored payloads of a checkpoint of it: codecs are measured on those, as tiles would
    flatter zstd."""
    seeds, snaps, real = _prefill(eng, _prompts(sessions, min(prefill, tokens)))
    eng.release(seeds)
    store = MemoryStore()
    w = CheckpointWriter(store, new_checkpoint_id())
    for i, sn in enumerate(snaps):
        reps = -(-tokens // sn.num_kv_tokens)
        st = sn.state
        st.session_id, st.prompt_token_ids = f"snap-{i}", (st.prompt_token_ids * reps)[:tokens]
        st.num_computed = sn.num_kv_tokens = tokens
        sn.state = st
        sn.kv = [(lo, hi, t.repeat(1, 1, 1, reps, 1)[:, :, :, :tokens].contiguous()) for lo, hi, t in sn.kv]
    write_snapshot(snaps, w)
    w.commit(model_ref(eng), eng.layout.to_dict(), geometry(eng), {})
    return restore(eng, CheckpointReader(store, w.checkpoint_id)), real


def _dtype_payloads(model: str, dtype: str, kv_dtype: str, sessions: int, prefill: int, per_tok: int
                    ) -> tuple[list[bytes], int]:
    """The stored payloads of the same prefilled prompts on an engine of `dtype` / `kv_dtype`, and its
    KV bytes per token (all layers and heads; fp8 with its scales)."""
    eng = LLMEngine(model, dtype=dtype, kv_dtype=kv_dtype, kv_cache_bytes=int(per_tok * (prefill + 64) * sessions * 1.5),
                    max_prefill_tokens=max(512, prefill))
    try:
        _, snaps, payloads = _prefill(eng, _prompts(sessions, prefill))
        pool = eng.executor.runner.kv  # type: ignore[attr-defined]
        k0 = pool.k[0]
        per = 2 * len(pool.k) * eng.cfg.num_kv_heads * (k0.shape[3] * k0.element_size() + (4 if pool.quantised else 0))
        return payloads, per
    finally:
        eng.shutdown()


def _codecs(raw: list[bytes], itemsize: int, reps: int, threads: int = 0) -> dict[str, dict[str, float]]:
    res = measure_codecs(raw, itemsize, reps, threads)  # one thread: per-core figures (threads: totals)
    return {k: {m: round(x, 3) for m, x in v.items()} for k, v in res.items()}


def _joined(chunks: list[bytes], itemsize: int) -> list[bytes]:
    """`chunks` joined into inputs of about MT_CHUNK_BYTES (whole elements each)."""
    out, cur = [], b""
    for c in chunks:
        cur += c
        if len(cur) >= MT_CHUNK_BYTES:
            out.append(cur[: len(cur) // itemsize * itemsize])
            cur = b""
    return out + ([cur[: len(cur) // itemsize * itemsize]] if len(cur) >= itemsize else [])


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
    # float32 whatever the device (per_tok above counts 4 bytes); other dtypes' KV: the codec figures
    src = LLMEngine(model, kv_cache_bytes=room, max_prefill_tokens=max(512, tokens), dtype="float32")
    dst = LLMEngine(model, kv_cache_bytes=room, max_prefill_tokens=max(512, tokens), dtype="float32")
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
            dst.release(got)  # free the blocks for the next try
            return dt

        t_rest = _best(restore_once, reps)
        gb = ids_kv / 1e9
        res.update(kv_bytes=ids_kv, memcpy_gbps=_sig(gb / t_mem), snapshot_gbps=_sig(gb / t_snap),
                   restore_gbps=_sig(gb / t_rest))
        res["snapshot_vs_memcpy"] = _sig(t_mem / t_snap)
        res["restore_vs_memcpy"] = _sig(t_mem / t_rest)
        log("codecs…")
        sample, res["codec_sample_bytes"] = [], 0
        for raw in real:  # whole chunks, up to CODEC_SAMPLE_BYTES of float32 KV
            if res["codec_sample_bytes"] < CODEC_SAMPLE_BYTES:
                sample.append(raw)
                res["codec_sample_bytes"] += len(raw)
        res["codec_chunks"] = len(sample)
        by_dtype = {"float32": _codecs(sample, 4, reps)}
        sizes, samples = {"float32": 4}, {"float32": sample}
        res["kv_bytes_per_token"] = {"float32": per_tok}
        for name, (dtype, kv_dtype) in KV_DTYPES.items():
            if name == "float32":
                continue
            log(f"codecs on {name} KV (a second engine: {dtype} model, KV {kv_dtype})…")
            payloads, res["kv_bytes_per_token"][name] = _dtype_payloads(model, dtype, kv_dtype, sessions,
                                                                        min(prefill, tokens), per_tok)
            # the same chunks (sessions, layers, token ranges) as the float32 sample
            sizes[name], samples[name] = 1 if kv_dtype == "fp8_e4m3" else 2, payloads[: len(sample)]
            by_dtype[name] = _codecs(samples[name], sizes[name], reps)
        res["codecs_by_dtype"] = by_dtype
        log(f"zstd-planes with {MT_THREADS} zstd workers on inputs of {MT_CHUNK_BYTES >> 20} MiB…")
        res["zstd_planes_mt"] = {"threads": MT_THREADS, "input_bytes": MT_CHUNK_BYTES, "by_dtype": {
            name: _codecs(_joined(samples[name], sizes[name]), sizes[name], reps, MT_THREADS)["zstd-planes"]
            for name in by_dtype}}
        res["codecs"], res["codecs_bf16"] = by_dtype["float32"], by_dtype["bfloat16"]
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
    c = Table(title=f"codecs on {res['codec_chunks']} chunks of prefilled KV per dtype ({res['codec_sample_bytes'] / 2**20:.1f} "
                    "MiB in float32), each dtype's own engine (GB/s per core: encode+decode, encode / decode)")
    for col in ("KV dtype", "bytes/token", "codec", "ratio", "GB/s", "enc / dec"):
        c.add_column(col, justify="right")
    for dtype, table in res["codecs_by_dtype"].items():
        for name in CODECS:
            a = table[name]
            c.add_row(dtype if name == CODECS[0] else "", f"{res['kv_bytes_per_token'][dtype]}" if name == CODECS[0] else "",
                      name, f"{a['ratio']:.3f}", f"{a['gbps']:.2f}", f"{a['encode_gbps']:.2f} / {a['decode_gbps']:.2f}")
    console.print(c)
    mt = res["zstd_planes_mt"]
    console.print(f"zstd-planes, {mt['threads']} zstd workers, inputs of {mt['input_bytes'] >> 20} MiB (total GB/s, "
                  "encode+decode, encode / decode; ratio): " + "; ".join(
                      f"{d} {a['gbps']:.2f}, {a['encode_gbps']:.2f} / {a['decode_gbps']:.2f}; {a['ratio']:.3f}"
                      for d, a in mt["by_dtype"].items()))
