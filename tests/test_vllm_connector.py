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


def _side_and_request(tmp_path, sid: str = "s1", serve: bool = False, params: dict | None = None):
    from relayout.engine.vllm.connector import SchedulerSide
    from relayout.engine.vllm.exchange import Exchange
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    ex = Exchange.init(tmp_path / "exchange")
    (ex.dir / "x1").mkdir()
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=32),
                          parallel_config=SimpleNamespace(tensor_parallel_size=2))
    side = SchedulerSide(cfg, {"exchange": str(ex.dir), "serve_control": serve})
    side.kv_cache_manager = _Blocks()
    kv_params = ex.transfer_params(sid) if params is None else params
    req = Request("r1", list(range(70)), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": kv_params}),
                  None)
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


def test_an_export_of_a_running_request_is_answered_at_the_next_step(tmp_path):
    side, _ = _side_and_request(tmp_path)
    t, out = _call(side, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "x1"})
    time.sleep(0.2)
    assert t.is_alive() and out == {}  # it waits for a step: the KV is consistent only there
    meta = _step(side)
    t.join(5)
    assert out == {"ok": True, "ranks": 2, "tok_hi": 40}
    assert [(e.block_ids, e.tok_lo, e.tok_hi) for e in meta.exports] == [([7, 8], 0, 40)]


def test_an_export_whose_request_ends_while_it_waits_is_answered_finished_without_a_step(tmp_path):
    from relayout.engine.vllm.exchange import ExchangeError, control
    from vllm.v1.request import RequestStatus

    side, req = _side_and_request(tmp_path, serve=True)
    sock = str(side.exchange.control_socket)  # the replica's path: a unix socket, one JSON line
    raised: list[ExchangeError] = []

    def export() -> None:
        try:
            control(sock, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "x1"}, timeout=60)
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


def test_an_export_of_a_request_that_is_not_running_is_a_failure_not_an_end(tmp_path):
    from vllm.v1.request import RequestStatus

    side, req = _side_and_request(tmp_path)
    req.status = RequestStatus.PREEMPTED
    t, out = _call(side, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "x1"})
    _step(side)
    t.join(5)
    assert out["ok"] is False and "PREEMPTED" in out["error"] and not out.get("finished")  # named, not "ended"


def test_only_params_signed_by_this_exchange_and_used_once_name_a_session(tmp_path):
    """Any client of vLLM's port can send kv_transfer_params: unsigned, forged, another launch's or a
    replayed body is a plain request (it claims no session, loads nothing, cannot take over an export)."""
    from relayout.engine.vllm.exchange import LOAD_KEY, SESSION_KEY, Exchange
    from vllm import SamplingParams
    from vllm.v1.request import Request

    load = {"tokens": 64, "files": [{"name": "f.safetensors", "tok_lo": 0, "tok_hi": 64, "hash": "0"}]}
    other = Exchange.init(tmp_path / "other")  # another replica's (or an earlier launch's) secret
    for params in ({SESSION_KEY: "s1", LOAD_KEY: load},  # unsigned
                   {**other.transfer_params("s1", load)},  # signed with another secret
                   {**other.transfer_params("s1", load), SESSION_KEY: "s2"}):  # tampered
        side, req = _side_and_request(tmp_path / str(abs(hash(str(params)))), params=params)
        assert side.sessions == {} and side.get_num_new_matched_tokens(req, 0) == (0, False)
        _, out = _call(side, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "x1"})
        time.sleep(0.1)
        assert out["ok"] is False and out.get("finished")  # no such session: nothing exported

    side, req = _side_and_request(tmp_path / "own")
    signed = side.exchange.transfer_params("s9", load)
    first = Request("r2", list(range(70)), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": signed}),
                    None)
    side.on_new_request(first)
    assert side.sessions["s9"] is first and side.get_num_new_matched_tokens(first, 0) == (64, False)
    replay = Request("r3", list(range(70)), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": signed}),
                     None)
    side.on_new_request(replay)  # the same signed body again: refused, the session stays with its request
    assert side.sessions["s9"] is first and side.get_num_new_matched_tokens(replay, 0) == (0, False)


def test_a_resumed_request_recomputes_instead_of_reading_blocks_that_hold_nothing(tmp_path):
    """A moved request vLLM preempts after its load comes back in the scheduler's cached requests,
    asked for external tokens again: the connector offers its KV once, so vLLM recomputes it."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    side, _ = _side_and_request(tmp_path)
    load = {"id": "l-1", "tokens": 64, "files": [{"name": "f.safetensors", "tok_lo": 0, "tok_hi": 64, "hash": "0"}]}
    req = Request("r2", list(range(70)), SamplingParams(
        max_tokens=8, extra_args={"kv_transfer_params": side.exchange.transfer_params("s2", load)}), None)
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (64, False)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), 64)
    meta = _step(side)
    assert [(s.load_id, s.tok_lo, s.tok_hi, s.block_ids) for s in meta.loads] == [("l-1", 0, 64, [7, 8, 9])]
    # preempted, then resumed: asked again with nothing computed
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],)), 0)
    assert _step(side).loads == []


def _worker(tmp_path, layers: int = 2, heads: int = 2, dim: int = 4, blocks: int = 8, bs: int = 4):
    import torch
    from relayout.engine.vllm.exchange import Exchange
    from relayout.engine.vllm.kv import WorkerSide

    ex = Exchange.init(tmp_path / "ex")
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=bs), device_config=SimpleNamespace(device_type="x"),
                          model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads))
    w = WorkerSide(cfg, {"exchange": str(ex.dir)})
    w.head_lo, w.head_hi = 0, heads
    caches = [torch.zeros(blocks, heads, bs, 2 * dim) for _ in range(layers)]
    w.views = [w._views(t) for t in caches]
    return w, ex, caches


def test_a_failed_load_is_reported_as_blocks_to_recompute_never_raised(tmp_path):
    """Each damaged or foreign file: the worker's step goes on, the request's blocks come back through
    get_block_ids_with_load_errors (vLLM recomputes them), `<load id>.failed` says why, and the cache
    is untouched. A good file loads exactly."""
    import torch
    from relayout.engine.vllm.exchange import damage_staged, write_kv
    from relayout.engine.vllm.kv import LoadSpec, RelayoutMetadata

    planted = tmp_path / "planted.safetensors"  # our own format, outside the exchange
    kv = torch.randn(2, 2, 2, 8, 4)
    write_kv(planted, kv, 0, 2, 0, 8)
    cases = {"missing": None, "truncate": None, "shape": None, "hash": None,
             "outside": {"name": "../planted.safetensors"}, "absolute": {"name": str(planted)},
             "etc": {"name": "/etc/hostname"}, "dtype": None}
    for i, (fault, override) in enumerate(cases.items()):
        w, ex, caches = _worker(tmp_path / fault)
        data = kv.double() if fault == "dtype" else kv
        entry = {"name": "f.safetensors", "tok_lo": 0, "tok_hi": 8,
                 "hash": write_kv(ex.dir / "f.safetensors", data, 0, 2, 0, 8)}
        if fault in ("missing", "truncate", "shape", "hash"):
            entry = damage_staged(ex.dir, entry, fault)
        entry = {**entry, **(override or {})}
        w.start_step(RelayoutMetadata(loads=[LoadSpec(f"l-{i}", [entry], [5, 2, 7], 0, 8, "r1")]))
        assert w.take_load_errors() == {5, 2}, fault
        assert (ex.dir / f"l-{i}.failed").read_text(), fault
        assert all(not c.any() for c in caches), fault  # nothing entered the cache
    w, ex, caches = _worker(tmp_path / "good")
    entry = {"name": "f.safetensors", "tok_lo": 0, "tok_hi": 8, "hash": write_kv(ex.dir / "f.safetensors", kv, 0, 2, 0, 8)}
    w.start_step(RelayoutMetadata(loads=[LoadSpec("l-ok", [entry], [5, 2, 7], 0, 8, "r1")]))
    assert w.take_load_errors() == set() and not (ex.dir / "l-ok.failed").exists()
    for layer, (k, v) in enumerate(w.views):
        b, o = w._index([5, 2, 7], 0, 8)
        assert torch.equal(k[b, :, o].transpose(0, 1), kv[layer, 0]) and torch.equal(v[b, :, o].transpose(0, 1), kv[layer, 1])


def test_exports_copy_off_the_forward_path_and_hold_blocks_until_done(tmp_path, monkeypatch):
    """The worker's step only starts an export: the copy and the file happen on its I/O thread; a
    request that ends meanwhile is reported finished sending (its blocks freed by vLLM) only once its
    copy is done, exactly once; a preemption waits for its copies; the file holds exactly the tokens."""
    import threading

    import torch
    from relayout.engine.vllm import kv as vllm_kv
    from relayout.engine.vllm.exchange import KVFile
    from relayout.engine.vllm.kv import ExportSpec, RelayoutMetadata, copy_blocks_out

    w, ex, caches = _worker(tmp_path, blocks=8, bs=4)
    for c in caches:
        c.copy_(torch.randn_like(c))
    (ex.dir / "x1").mkdir()
    gate, real_write = threading.Event(), vllm_kv.write_kv
    monkeypatch.setattr(vllm_kv, "write_kv", lambda *a: (gate.wait(10), real_write(*a))[1])
    w.start_step(RelayoutMetadata(exports=[ExportSpec(str(ex.dir / "x1"), [5, 2, 7], 3, 10, "r1")]))
    assert not (ex.dir / "x1" / "rank0.safetensors").exists()  # the step returned; the copy runs on
    assert w.finished_sending(set()) is None
    assert w.finished_sending({"r1", "r-other"}) is None  # r1 ended, its copy is not done: blocks held
    gate.set()
    deadline = time.monotonic() + 10
    while (done := w.finished_sending(set())) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert done == {"r1"} and w.finished_sending(set()) is None  # once
    got = KVFile.open(ex.dir / "x1" / "rank0.safetensors").read()
    b, o = w._index([5, 2, 7], 3, 10)
    want = torch.stack([torch.stack([k[b, :, o], v[b, :, o]]).transpose(1, 2) for k, v in w.views])
    assert torch.equal(got, want)
    assert torch.equal(copy_blocks_out(w.views, [5, 2, 7], 4, 3, 10), want)

    gate.clear()
    w.start_step(RelayoutMetadata(exports=[ExportSpec(str(ex.dir / "x1"), [1, 3], 0, 8, "r2")]))
    waited = threading.Thread(target=w.wait_exports, args=(["r2"],), daemon=True)
    waited.start()
    waited.join(0.3)
    assert waited.is_alive()  # a preemption of r2 waits for its copy before its blocks are reused
    gate.set()
    waited.join(10)
    assert not waited.is_alive()


def test_the_scheduler_holds_an_exported_requests_blocks_at_its_end(tmp_path):
    side, req = _side_and_request(tmp_path)
    t, _ = _call(side, {"op": "export", "session": "s1", "lo": 0, "hi": 40, "dir": "x1"})
    meta = _step(side)
    t.join(5)
    assert [e.req_id for e in meta.exports] == ["r1"]
    assert side.request_finished(req, [7, 8, 9]) == (True, None)  # freed when the workers say so
    other, req2 = _side_and_request(tmp_path / "b")
    assert other.request_finished(req2, [7]) == (False, None)  # never exported: freed at once
