"""Traces of the operations that move sessions (docs/observability.md), across real processes.

The migrator runs here with an in-memory span exporter; the replicas (and the agent) are real
processes exporting by OTLP/HTTP to a receiver this test runs. The tree is asserted by span
names, parents (the replicas' server spans continue the migrator's `traceparent`) and bytes."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from relayout.engine import tracing
from relayout.migrate import procs
from relayout.migrate.protocol.live import MigrationPlan, migrate_live

from tests.helpers.agents import TOKEN, H, start_agent, stop, wait_op
from tests.helpers.migration import streams_on, wait_for
from tests.helpers.otlp_sink import OTLPSink

BODY = {"prompt": "trace me", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def sink():
    s = OTLPSink()
    yield s
    s.close()


@pytest.fixture(scope="module")
def memory_spans():
    """This process's spans, in memory (the SDK installed once; later tests in the process keep it)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # stops recording into it


@pytest.fixture(scope="module")
def replicas(sink):
    env = {**sink.env(), "RELAYOUT_TOKEN": None}
    ps = [procs.replica(env=env, wait=False) for _ in range(2)]
    try:
        yield [p.wait_ready(180) for p in ps]
    finally:
        for p in ps:
            p.stop()


def test_exporter_only_from_the_environment(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
                "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    assert tracing.exporter_from_env() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.exporter_from_env() == "otlp"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.exporter_from_env() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracing.exporter_from_env() == "console"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.exporter_from_env() is None


def test_live_migration_span_tree(replicas, sink, memory_spans):
    src, dst = replicas
    streams = streams_on(src, [BODY, {**BODY, "prompt": "and me too"}], [dst])
    res = migrate_live(src, dst, plan=MigrationPlan(small_bytes=0, max_rounds=3))
    assert sorted(res.sessions) == sorted(s.sid for s in streams)

    first = wait_for(lambda: [s for s in memory_spans.get_finished_spans() if s.name == "first-token"], 30)
    assert first and first[0].attributes["relayout.outcome"] == "token", first
    spans = memory_spans.get_finished_spans()
    (root,) = [s for s in spans if s.name == "migration"]
    assert root.parent is None and root.attributes["relayout.transfer"] == res.transfer_id
    assert root.attributes["relayout.bytes"] == res.bytes_total
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    names = [s.name for s in sorted(kids, key=lambda s: s.start_time)]
    rounds = [s for s in kids if s.name == "pre-copy"]
    assert names == ["pre-copy"] * len(rounds) + ["stop-and-copy", "prepared", "committed", "first-token"], names
    assert len(rounds) == len(res.rounds) - 1 >= 1
    assert [s.attributes["relayout.round"] for s in rounds] == list(range(len(rounds)))
    assert [s.attributes["relayout.bytes"] for s in rounds] == [r.bytes for r in res.rounds[:-1]]
    assert all(s.attributes["relayout.bytes"] > 0 for s in rounds)
    (final,) = [s for s in kids if s.name == "stop-and-copy"]
    assert final.attributes["relayout.bytes"] == res.rounds[-1].bytes > 0
    phase_id = {s.name: s.context.span_id for s in kids if s.name != "pre-copy"}

    # the replicas' server spans hang below the phase that called them, in the same trace: each
    # round is an export on the source (child of its phase), which pushes the frames to the target's
    # import (child of that export) -- the migrator itself carries no KV
    trace_id = root.context.trace_id
    exports = sink.find(lambda s: s.trace_id == trace_id and s.name == "POST /v1/sessions/export",
                        count=len(res.rounds))
    # (the import is the HTTP route's span, or over the frame link, the default transport, the link round's)
    imports = sink.find(lambda s: s.trace_id == trace_id and s.name in ("POST /v1/sessions/import",
                                                                        "LINK /v1/sessions/import"),
                        count=len(res.rounds))
    assert len(exports) == len(imports) == len(res.rounds), [(s.span_id, s.parent_id) for s in exports + imports]
    export_of = {s.parent_id: s for s in exports}
    import_of = {s.parent_id: s for s in imports}
    for phase, nbytes in [*((s.context.span_id, s.attributes["relayout.bytes"]) for s in rounds),
                          (final.context.span_id, final.attributes["relayout.bytes"])]:
        exp = export_of[phase]
        imp = import_of[exp.span_id]
        assert exp.service == imp.service == "relayout-replica"
        received = imp.attributes.get("http.request.body.size", imp.attributes.get("relayout.bytes"))
        assert received == nbytes  # what the target received is what moved
        assert imp.attributes.get("http.response.status_code", imp.attributes.get("relayout.status")) == 200
        assert exp.attributes["http.response.status_code"] == 200
    # the migrator got control messages only, never the frames
    assert sum(s.attributes["http.response.body.size"] for s in exports) < sum(r.bytes for r in res.rounds) // 4
    (release,) = sink.find(lambda s: s.trace_id == trace_id and s.name == "POST /v1/sessions/release")
    assert release.parent_id == phase_id["prepared"]
    (commit,) = sink.find(lambda s: s.trace_id == trace_id and s.name == "POST /v1/sessions/transfers/{transfer}/commit")
    assert commit.parent_id == phase_id["committed"]
    (stream,) = sink.find(lambda s: s.trace_id == trace_id and s.name == "GET /v1/sessions/{sid}/stream")
    assert stream.parent_id == phase_id["first-token"]
    for s in streams:
        s.join(120)


def test_checkpoint_then_restore_span_tree(sink, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYOUT_TOKEN", TOKEN)
    for k, v in sink.env().items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    p, agent = start_agent(tmp_path / "a", tmp_path / "a.log")
    try:
        r = httpx.post(f"{agent}/v1/replicas", headers=H, json={"model": "builtin:tiny"}, timeout=200)
        assert r.status_code == 201, r.text
        rep = r.json()
        streams_on(rep["url"], [BODY], [])  # a session to checkpoint (ended by the checkpoint's stop)
        oid = httpx.post(f"{agent}/v1/replicas/{rep['id']}/checkpoint", headers=H, json={"stop": True}).json()
        ck = wait_op(agent, oid["operation_id"])
        assert ck["state"] == "succeeded", ck
        oid = httpx.post(f"{agent}/v1/restore", headers=H,
                         json={"checkpoint": ck["result"]["checkpoint"], "replica": rep["id"]}).json()
        rs = wait_op(agent, oid["operation_id"])
        assert rs["state"] == "succeeded" and rs["result"]["sessions"] == ck["result"]["sessions"], rs

        (op_ck,) = sink.find(lambda s: s.name == "checkpoint" and s.attributes.get("relayout.operation") == ck["id"])
        assert op_ck.service == "relayout-agent" and op_ck.attributes["relayout.state"] == "succeeded"
        (writing,) = sink.find(lambda s: s.name == "checkpointing" and s.parent_id == op_ck.span_id)
        assert writing.attributes["relayout.bytes"] == ck["result"]["bytes"] > 0
        (route,) = sink.find(lambda s: s.name == "POST /v1/sessions/checkpoint" and s.parent_id == writing.span_id)
        assert route.service == "relayout-replica" and route.trace_id == op_ck.trace_id

        (op_rs,) = sink.find(lambda s: s.name == "restore" and s.attributes.get("relayout.operation") == rs["id"])
        (restoring,) = sink.find(lambda s: s.name == "restoring" and s.parent_id == op_rs.span_id)
        assert restoring.attributes["relayout.sessions"] == ck["result"]["sessions"]
        (route,) = sink.find(lambda s: s.name == "POST /v1/sessions/restore" and s.parent_id == restoring.span_id)
        assert route.service == "relayout-replica" and route.trace_id == op_rs.trace_id
    finally:
        stop(p)


def test_decode_path_never_loads_opentelemetry():
    """Nil overhead on decode without an OTLP endpoint, by construction: the engine and its decode
    loop never import OpenTelemetry (only the HTTP front ends do, and their spans are no-ops then)."""
    code = ("import sys\n"
            "from relayout.engine.runtime.engine import LLMEngine\n"
            "from relayout.engine.runtime.session import SamplingParams\n"
            "e = LLMEngine('builtin:tiny')\n"
            "out = e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))\n"
            "e.shutdown()\n"
            "assert len(out[0]) == 4, out\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout
