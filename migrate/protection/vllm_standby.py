"""Protection's standby half on a vLLM replica (migrate.protection.standby.StandbyKeeper): the copies of the
source's sessions are staged load files in this replica's exchange directory, one per round and
session (the KV the round brought), written as rounds arrive; vLLM's cache holds nothing of them
until a promotion. Promotion resubmits each session's request with every file of it to load
(engine.vllm.connector), as a restore does: vLLM recomputes only what no round brought (the tail
told at promotion, and the last token).

A seeded sampled session is not held (vLLM seeds one generator per request, so a resubmitted request
would change its tokens): the round's answer names it under `not_held`, and the source says so."""

from __future__ import annotations

from relayout.engine.moves.placer import check_entry
from relayout.engine.runtime.engine import finish_reason_after
from relayout.engine.runtime.session import SessionState
from relayout.engine.vllm.engine import VllmEngine
from relayout.migrate.protection.standby import Held, tail_of
from relayout.migrate.protocol.vllm_ops import VllmOps, not_movable
from relayout.storage.checkpoint import CheckpointReader
from relayout.storage.format.manifest import Manifest


class StagedKeeper:
    def __init__(self, ops: VllmOps):
        self.ops = ops

    async def take(self, h: Held, manifest: Manifest) -> dict:
        ops, e = self.ops, self.ops.engine
        ops.check(manifest)
        reader = CheckpointReader(h.store, manifest=manifest)
        held, not_held, imported = [], {}, 0
        for en in manifest.sessions:
            st = check_entry(e, en)  # type: ignore[arg-type]
            if (why := not_movable(st)) is not None:
                not_held[st.session_id] = why
                continue
            imported += await ops.stage_new(h.pid, reader, h.upto, en)
            held.append(st.session_id)
        for sid in [sid for sid in h.upto if sid not in held]:  # finished on the source: its files go
            ops.drop_files(h.pid, sid)
            h.upto.pop(sid)
        return {"sessions": sorted(held), "imported_tokens": imported, "not_held": not_held}

    async def promote(self, h: Held, told: dict[str, list[int]]) -> dict[str, int]:
        assert h.manifest is not None
        entries = [en for en in h.manifest.sessions if en.session_id in h.upto]
        states = {en.session_id: (SessionState.from_dict(en.state), en.num_kv_tokens) for en in entries}
        tails = {sid: tail_of(st, told.get(sid)) for sid, (st, _) in states.items()}  # all checked first

        def place(e: VllmEngine) -> dict[str, int]:
            out = {}
            for sid, (st, n_kv) in states.items():
                tail = tails[sid] if st.sampling.logprobs is None else []  # logprobs: regenerate the tail instead
                st.output_token_ids += tail
                st.num_computed = n_kv  # vLLM recomputes the tail (and the last token) by prefill
                e.adopt(st, self.ops.take_load(h.pid, sid, n_kv))
                if tail and (reason := finish_reason_after(st, st.output_token_ids[-1], e.tokenizer)) is not None:
                    e.abort(sid, reason)  # the tail told ends it: finished here with what the client has
                out[sid] = len(tail)
            e.resume(list(out))
            return out

        return await self.ops.aengine.call(place)

    async def drop(self, h: Held) -> None:
        self.ops.drop_files(h.pid)
        h.upto.clear()
