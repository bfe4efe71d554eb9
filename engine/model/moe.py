"""Sparse MoE block: route, dispatch to the ranks that hold the chosen experts, combine.

Every token's k choices are computed as (token, choice) pairs; each pair is sent to a
physical slot holding its expert, chosen by the dispatch rule the planner scores with
(engine.model.dispatch: the rank's own copy first, copies spread round-robin); the results come back in
pair order and are combined with the router weights by the same code on every layout, which is
why layouts agree to float rounding.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from relayout.engine.model.batch_invariant import batch_invariant, linear
from relayout.engine.model.config import ModelConfig
from relayout.engine.model.dispatch import candidate_slots
from relayout.engine.model.parallel import ParallelState

_GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.10; a per-expert loop otherwise
# the integer type of each activation width: a pair's local slot index travels beside its row as
# that integer's bits (a bfloat16 value holds integers exactly only up to 256)
_SLOT_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class ExpertShard(torch.nn.Module):
    """The physical expert slots one rank holds (each possibly a moe_tp slice)."""

    def __init__(self, num_slots: int, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        # gate and up projections stacked: one matmul per expert instead of two
        self.w_gate_up = torch.nn.Parameter(torch.empty(num_slots, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.inter = inter
        self.w_down = torch.nn.Parameter(torch.empty(num_slots, hidden, inter, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, local_slot: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        if x.shape[0] == 0:
            return out
        order = torch.argsort(local_slot, stable=True)
        counts = torch.bincount(local_slot, minlength=self.w_gate_up.shape[0])
        xs = x[order]
        if x.dtype == torch.float32 and x.device.type == "cpu":
            n = x.shape[0]
            if n <= 8:  # a handful of rows: one small GEMM per expert hit is the cheapest
                return self._per_expert(xs, counts, order, out)
            most = int(counts.max())
            if n <= 256 and most * counts.shape[0] <= 4 * n:
                return self._padded(xs, counts, order, local_slot, most, out)
        if _GROUPED_MM is not None and x.dtype in (torch.float32, torch.bfloat16):
            # one grouped GEMM per projection over every slot's rows (no per-expert Python loop)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            gu = _GROUPED_MM(xs, self.w_gate_up.transpose(1, 2), offs=offs)
            h = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
            out[order] = _GROUPED_MM(h, self.w_down.transpose(1, 2), offs=offs)
            return out
        return self._per_expert(xs, counts, order, out)

    def _per_expert(self, xs: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ys = []
        start = 0
        # half precision: the batch-invariant product (a lone row, a narrow float16 one), so a session's
        # output does not depend on whether other tokens of its batch picked the same expert
        mm = linear if batch_invariant(xs.dtype) else (lambda a, w: a @ w.T)
        for s, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            gu = mm(xs[start : start + n], self.w_gate_up[s])
            h = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
            ys.append(mm(h, self.w_down[s]))
            start += n
        out[order] = torch.cat(ys)
        return out

    def _padded(self, xs: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, local_slot: torch.Tensor,
                most: int, out: torch.Tensor) -> torch.Tensor:
        """A decode step's few rows per slot, padded to the busiest slot's count: two batched GEMMs
        over every slot. On the CPU a decode step streams each slot's weights from memory, and one
        bmm splits the slots across the cores where the per-slot loop splits each small GEMM
        (measured on builtin:bench, 16 sessions: 1.05 ms per layer against 1.77 ms)."""
        slots = local_slot[order]
        # row j of slot s sits at [s, j]; padding rows are zeros and their outputs are never read
        pos = torch.arange(xs.shape[0]) - (torch.cumsum(counts, 0) - counts)[slots]
        buf = xs.new_zeros((counts.shape[0], most, xs.shape[1]))
        buf[slots, pos] = xs
        gu = torch.bmm(buf, self.w_gate_up.transpose(1, 2))
        h = F.silu(gu[..., : self.inter]) * gu[..., self.inter :]
        out[order] = torch.bmm(h, self.w_down.transpose(1, 2))[slots, pos]
        return out


class SparseMoE(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.ps, self.layer = cfg, ps, layer
        lay = ps.layout
        self.slots = list(lay.slots(layer, cfg.num_experts))
        self.slots_per_rank = len(self.slots) // lay.moe_ep
        ep = lay.ep_rank(ps.rank)
        self.local_slots = self.slots[ep * self.slots_per_rank : (ep + 1) * self.slots_per_rank]
        inter = cfg.moe_intermediate_size // lay.moe_tp
        self.inter_range = (lay.moe_tp_rank(ps.rank) * inter, (lay.moe_tp_rank(ps.rank) + 1) * inter)
        self.router = torch.nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.experts = ExpertShard(self.slots_per_rank, cfg.hidden_size, inter, dtype)
        # candidate table: logical expert -> the slots this rank's tokens go to, by the dispatch rule the
        # planner scores placements with (engine.model.dispatch: own rank's copies, else the node's, else all).
        # A replica's ranks are one node here (a multi-host replica's node map is not known to the engine)
        reps = candidate_slots(self.slots, lay.moe_ep, [0] * lay.moe_ep, ep, cfg.num_experts)
        width = max(len(r) for r in reps)
        self.register_buffer("rep_table", torch.tensor([r + [r[0]] * (width - len(r)) for r in reps]), persistent=False)
        self.register_buffer("rep_count", torch.tensor([len(r) for r in reps]), persistent=False)
        # no expert replicated: a pair's slot is a lookup by expert alone (five fewer ops per layer and step)
        self.single_copy = width == 1
        self.expert_counts = torch.zeros(cfg.num_experts, dtype=torch.long)  # tokens routed per logical expert
        self.bytes_to = [0] * ps.world_size
        self.exposed_s = 0.0
        self.total_s = 0.0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of each token and their weights (float32): the router's matmul runs in the
        model dtype, its softmax in float32, as transformers does."""
        logits = linear(x, self.router).float()
        probs = torch.softmax(logits, dim=-1)
        w, e = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, e  # float32: each expert's output is weighted in float32, then rounded once

    def forward(self, x: torch.Tensor, token_offset: int = 0) -> torch.Tensor:
        """x: the tokens this rank dispatches, [n, hidden]. `token_offset` spreads replicas."""
        n, k = x.shape[0], self.cfg.top_k
        w, e = self.route(x)
        flat_e = e.reshape(-1)
        self.expert_counts += torch.bincount(flat_e, minlength=self.cfg.num_experts)
        # spread a token over its candidate copies round-robin by token index (not by pair index,
        # which would tie the copy to the token's choice rank when top_k and copies share a factor)
        if self.single_copy:
            slot = self.rep_table[flat_e, 0]
        else:
            tok = torch.arange(n).repeat_interleave(k) + token_offset
            slot = self.rep_table[flat_e, tok % self.rep_count[flat_e]]
        xs = x.repeat_interleave(k, dim=0)
        y = self._exchange(xs, slot)
        return (y.view(n, k, y.shape[-1]).float() * w.unsqueeze(-1)).to(x.dtype).sum(dim=1)

    def _exchange(self, xs: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        if not self.ps.distributed:
            # one rank holds every slot (a slot is its own local index); moe_tp > 1 is impossible here
            return self.experts(xs, slot)
        lay = self.ps.layout
        ep_of_slot = slot // self.slots_per_rank
        local = slot % self.slots_per_rank
        world = lay.world_size
        mtp = lay.moe_tp
        # each pair goes to every moe_tp rank of its expert-parallel rank
        dest = (ep_of_slot.unsqueeze(1) * mtp + torch.arange(mtp)).reshape(-1)
        rows = xs.repeat_interleave(mtp, dim=0)
        loc = local.repeat_interleave(mtp)
        # two micro-batches when overlapping: one's exchange runs while the other computes
        n_mb = 2 if lay.overlap else 1
        bounds = [len(dest) * i // n_mb for i in range(n_mb + 1)]
        mbs = []
        for i in range(n_mb):
            d = dest[bounds[i] : bounds[i + 1]]
            order = torch.argsort(d, stable=True)
            slot_bits = loc[bounds[i] : bounds[i + 1]][order].to(_SLOT_INT[rows.element_size()]).view(rows.dtype)
            send = torch.cat([rows[bounds[i] : bounds[i + 1]][order], slot_bits.unsqueeze(1)], dim=1)
            mbs.append((order, send, torch.bincount(d, minlength=world)))
        t0 = time.perf_counter()
        send_counts = torch.cat([m[2] for m in mbs])
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.view(n_mb, world).T.contiguous().view(-1))
        recv_counts = recv_counts.view(world, n_mb).T.contiguous()
        exposed = time.perf_counter() - t0
        ops_time = exposed
        # dispatch every micro-batch asynchronously
        recvs, works, issued = [], [], []
        for i, (_, send, sc) in enumerate(mbs):
            rc = recv_counts[i].tolist()
            recv = send.new_empty((sum(rc), send.shape[1]))
            ti = time.perf_counter()
            issued.append(ti)
            works.append(dist.all_to_all_single(recv, send, rc, sc.tolist(), async_op=True))
            exposed += time.perf_counter() - ti  # gloo may do part of the transfer inside the call
            recvs.append((recv, rc, sc.tolist()))
        backs, bworks, bissued = [], [], []
        for i, (recv, rc, sc) in enumerate(recvs):
            tw = time.perf_counter()
            works[i].wait()
            tr = time.perf_counter()
            exposed += tr - tw
            ops_time += tr - issued[i]
            out = self.experts(recv[:, :-1].contiguous(), recv[:, -1].view(_SLOT_INT[recv.element_size()]).long())
            back = out.new_empty((sum(sc), out.shape[1]))
            ti = time.perf_counter()
            bissued.append(ti)
            bworks.append(dist.all_to_all_single(back, out, sc, rc, async_op=True))
            exposed += time.perf_counter() - ti
            backs.append(back)
        for i, w in enumerate(bworks):
            tw = time.perf_counter()
            w.wait()
            tr = time.perf_counter()
            exposed += tr - tw
            ops_time += tr - bissued[i]
        elem = xs.element_size() * (xs.shape[1] + 1)
        res = torch.empty((len(dest), xs.shape[1]), dtype=xs.dtype)
        for i, (order, _, sc) in enumerate(mbs):
            for r, c in enumerate(sc.tolist()):
                self.bytes_to[r] += c * elem
            part = torch.empty_like(backs[i])
            part[order] = backs[i]
            res[bounds[i] : bounds[i + 1]] = part
        # exposed: time this rank sat waiting on the exchange; total: time the exchange was
        # in flight (issue to completion seen) — without overlap the two are equal
        self.exposed_s += exposed
        self.total_s += max(ops_time, exposed)
        # sum moe_tp partials in tp order: deterministic
        return res.view(-1, mtp, res.shape[1]).sum(dim=1)
