"""Sampling with a generator that belongs to the session, so a session's tokens never
depend on what else is batched with it, and survive checkpoint and migration."""

from __future__ import annotations

import torch
from relayout.engine.runtime.session import SessionState


def new_rng_state(seed: int) -> bytes:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return _state_bytes(g)


# A CPU generator's state is 5056 bytes: through Python lists (list(bytes) -> torch.tensor, .tolist()
# -> bytes) a round trip cost ~280 us per sampled token (37% of the engine thread, 8 sessions of builtin:tiny)
def _generator(state: bytes) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return g


def _state_bytes(g: torch.Generator) -> bytes:
    return g.get_state().numpy().tobytes()


def sample(logits: torch.Tensor, s: SessionState) -> int:
    """One token for one session from its last-position logits [vocab] (float32, CPU)."""
    p = s.sampling
    if p.greedy:
        return int(torch.argmax(logits).item())
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, dim=-1) - sp < p.top_p  # always keeps the top token
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
        probs = probs / probs.sum()
    assert s.rng_state is not None, "sampled sessions get an RNG state at admission"
    g = _generator(s.rng_state)
    tok = int(torch.multinomial(probs, 1, generator=g).item())
    s.rng_state = _state_bytes(g)
    return tok


def advance_rng(s: SessionState, vocab_size: int, n: int) -> None:
    """Move a sampled session's generator past `n` tokens it sampled elsewhere (a promoted standby
    recomputing a tail it was told, not sampled): `sample` draws one multinomial over the whole
    vocabulary per token, and what that consumes from the generator depends on the shape, not the
    values (tests/test_protect.py checks it), so drawing over a uniform row advances it exactly."""
    if s.sampling.greedy or n <= 0 or s.rng_state is None:
        return
    g = _generator(s.rng_state)
    row = torch.ones(vocab_size, dtype=torch.float32)
    for _ in range(n):
        torch.multinomial(row, 1, generator=g)
    s.rng_state = _state_bytes(g)
