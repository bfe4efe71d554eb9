"""deploy/grafana/relayout.json: a well-formed Grafana dashboard whose every query names only metrics
that a running agent and replica export on /metrics (docs/observability.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from relayout.migrate import procs

from tests.helpers.agents import TOKEN, H, start_agent, stop

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "relayout.json"
METRIC_RE = re.compile(r"\brelayout_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": (), "untyped": (), "info": ("_info",)}


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page can be queried by: its samples, and each declared family
    with the suffixes of its type (a labelled family without children yet has only its # TYPE line)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base, *(base + s for s in SUFFIXES.get(kind, ()))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def dashboard_queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every panel target and every templating query."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            out.append((f"variable {v['name']}", q["query"]))
    return out


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    charts = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(charts) >= 12
    for p in charts:
        assert p["targets"], p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p["targets"]:
            assert METRIC_RE.search(t["expr"]), (p["title"], t["expr"])
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for what in ("fleet", "per node", "per replica", "stall", "throughput"):
        assert what in titles, what


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    mp = pytest.MonkeyPatch()
    mp.setenv("RELAYOUT_TOKEN", TOKEN)
    p, agent = start_agent(tmp / "a", tmp / "a.log")
    gw = None
    try:
        r = httpx.post(f"{agent}/v1/replicas", headers=H, json={"model": "builtin:tiny"}, timeout=200)
        assert r.status_code == 201, r.text
        gw = procs.gateway("--agent", agent, "--port", "0")
        yield {"agent": agent, "replica": r.json()["url"], "gateway": gw.url}
    finally:
        if gw is not None:
            gw.stop()
        stop(p)
        mp.undo()


def test_every_panel_metric_is_exported(running):
    # a session on the replica, through the gateway: the per-replica figures are not all zero
    r = httpx.post(f"{running['gateway']}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    exported: set[str] = set()
    for what in ("agent", "replica"):
        resp = httpx.get(f"{running[what]}/metrics", timeout=30)
        assert resp.status_code == 200 and "text/plain" in resp.headers["content-type"]
        exported |= exported_names(resp.text)
    agent_page = httpx.get(f"{running['agent']}/metrics", timeout=30).text
    assert re.search(r'relayout_replica_kv_blocks_total\{replica="r-[0-9a-f]+"\} [1-9]', agent_page), agent_page
    assert re.search(r"^relayout_migration_stall_seconds_bucket", agent_page, re.M)
    missing = [(title, name) for title, expr in dashboard_queries(json.loads(DASHBOARD.read_text()))
               for name in METRIC_RE.findall(expr) if name not in exported]
    assert not missing, missing


def test_exported_names_reads_families_without_samples():
    page = "# HELP x_ops Ops\n# TYPE x_ops counter\n# TYPE x_lat histogram\nx_up 1.0\n"
    assert {"x_ops_total", "x_lat_bucket", "x_lat_count", "x_up"} <= exported_names(page)
    assert "x_nope" not in exported_names(page)
