"""SessionState.to_dict is what dataclasses.asdict makes of a state (status as its value, the RNG state
as hex), and a copy sharing nothing with it: a migration's cut takes it while the session goes on."""

from __future__ import annotations

from dataclasses import asdict

from relayout.engine.runtime.session import SamplingParams, SessionState, SessionStatus


def test_to_dict_is_asdicts_rendering_and_shares_nothing_with_the_session():
    st = SessionState("s1", list(range(300)), SamplingParams(max_tokens=5, temperature=0.7, stop=["a", "bb"],
                                                             stop_token_ids=[3, 4], logprobs=2),
                      output_token_ids=[5, 6, 7], rng_state=b"\x01\x02", status=SessionStatus.RUNNING,
                      logprobs=[[-0.5, [1, 2], [-0.1, -0.2]] for _ in range(3)], api="chat")
    d = st.to_dict()
    want = {**asdict(st), "status": "running", "rng_state": "0102"}
    assert d == want and list(d) == list(want)
    d["prompt_token_ids"].append(1)
    d["output_token_ids"].clear()
    d["sampling"]["stop"].append("x")
    d["logprobs"][0][1].append(9)
    assert (len(st.prompt_token_ids), st.output_token_ids, st.sampling.stop, st.logprobs[0][1]) == (300, [5, 6, 7],
                                                                                                    ["a", "bb"], [1, 2])
    assert SessionState.from_dict(st.to_dict()) == st
