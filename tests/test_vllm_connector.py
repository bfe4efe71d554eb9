"""The scheduler side of relayout's vLLM connector, in process: how an export command from the
replica is answered. vLLM's own `Request` objects; the KV cache manager is a stand-in that only
names a request's blocks (there is no vLLM engine here)."""

from __future__ import annotations

import threading
import time
from importlib.util import find_spec
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed (pip install -e '.[vllm]')")]


class _Blocks:
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([7, 8, 9],)


def _side_and_request(sid: str = "s1", control_socket: str | None = None):
    from relayout.engine.vllm_connector import SchedulerSide
    from relayout.engine.vllm_exchange import SESSION_KEY
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=32),
                          parallel_config=SimpleNamespace(tensor_parallel_size=2))
    side = SchedulerSide(cfg, {"control_socket": control_socket} if control_socket else {})
    side.kv_cache_manager = _Blocks()
    req = Request("r1", list(range(70)), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params":
                                                                                  {SESSION_KEY: sid}}), None)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, 70
    side.on_new_request(req)
    return side, req


def _call(side, msg: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(side.command(msg)), daemon=True)
    t.start()
    return t, out


def _step(side):
    return side.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))


def test_an_export_of_a_running_request_is_answered_at_the_next_step():
    side, _ = _side_and_request()
    t, out = _call(side, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "/x"})
    time.sleep(0.2)
    assert t.is_alive() and out == {}  # it waits for a step: the KV is consistent only there
    meta = _step(side)
    t.join(5)
    assert out == {"ok": True, "ranks": 2, "tok_hi": 40}
    assert [(e.block_ids, e.tok_lo, e.tok_hi) for e in meta.exports] == [([7, 8], 0, 40)]


def test_an_export_whose_request_ends_while_it_waits_is_answered_finished_without_a_step(tmp_path):
    from relayout.engine.vllm_exchange import ExchangeError, control
    from vllm.v1.request import RequestStatus

    sock = str(tmp_path / "control.sock")
    side, req = _side_and_request(control_socket=sock)  # the replica's path: a unix socket, one JSON line
    raised: list[ExchangeError] = []

    def export() -> None:
        try:
            control(sock, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "/x"}, timeout=60)
        except ExchangeError as e:
            raised.append(e)

    t = threading.Thread(target=export, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED  # vLLM ended it; an idle vLLM takes no more steps
    side.request_finished(req, [])
    t.join(5)  # before: it waited COMMAND_TIMEOUT_S (30 s) for a step, then said "no step came"
    assert not t.is_alive() and len(raised) == 1
    assert raised[0].finished and "no running request" in str(raised[0])
    assert _step(side).exports == []  # answered once: a later step exports nothing for it


def test_an_export_of_a_request_that_is_not_running_is_a_failure_not_an_end():
    from vllm.v1.request import RequestStatus

    side, req = _side_and_request()
    req.status = RequestStatus.PREEMPTED
    t, out = _call(side, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "/x"})
    _step(side)
    t.join(5)
    assert out["ok"] is False and "PREEMPTED" in out["error"] and not out.get("finished")  # named, not "ended"
