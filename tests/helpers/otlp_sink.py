"""A tiny OTLP/HTTP trace receiver for tests: the processes under test export their spans to it
with the standard exporter (`OTEL_EXPORTER_OTLP_ENDPOINT`), it decodes them with
opentelemetry-proto's own classes and keeps them as plain records."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class SinkSpan:
    service: str
    name: str
    trace_id: int
    span_id: int
    parent_id: int | None
    attributes: dict = field(default_factory=dict)


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OTLPSink:
    def __init__(self) -> None:
        self.spans: list[SinkSpan] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                got = []
                for rs in req.resource_spans:
                    res = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            got.append(SinkSpan(str(res.get("service.name")), s.name,
                                                int.from_bytes(s.trace_id, "big"), int.from_bytes(s.span_id, "big"),
                                                int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else None,
                                                {a.key: _value(a.value) for a in s.attributes}))
                with sink._lock:
                    sink.spans += got
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        """What a process needs to export here, promptly."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_SERVICE_NAME": None}  # type: ignore[dict-item]  # None: procs removes the variable

    def find(self, pred, timeout: float = 30.0, count: int = 1) -> list[SinkSpan]:
        """The spans matching `pred` once at least `count` arrived (fewer after `timeout`)."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                hits = [s for s in self.spans if pred(s)]
            if len(hits) >= count or time.monotonic() > end:
                return hits
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
