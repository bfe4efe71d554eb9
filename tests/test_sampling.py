"""A sampled session's generator lives in its state as bytes (it travels with checkpoints and
migrations): carried through those bytes from token to token, it draws exactly what one torch
generator seeded once draws."""

from __future__ import annotations

import torch
from relayout.engine.runtime.sampling import new_rng_state, sample
from relayout.engine.runtime.session import SamplingParams, SessionState


def test_sampling_through_the_sessions_state_bytes_is_one_seeded_generator():
    p = SamplingParams(temperature=1.0, seed=11)
    s = SessionState("s", [1], p, rng_state=new_rng_state(p.seed))
    g = torch.Generator(device="cpu")
    g.manual_seed(p.seed)
    logits = [torch.randn(500, generator=torch.Generator().manual_seed(i)) * 2 for i in range(40)]
    got = [sample(x, s) for x in logits]
    want = [int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=g).item()) for x in logits]
    assert got == want and len(set(got)) > 5
    assert s.rng_state == g.get_state().numpy().tobytes()
