"""`relayout up`: agent + one builtin:tiny replica + gateway; a completion through the gateway with the
openai client; SIGTERM stops everything (exit 0, no process left behind)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from openai import OpenAI
from relayout.engine.ranks.rank_channel import free_port
from relayout.migrate import procs
from relayout.migrate.procs import alive, process_tree


def test_up_serves_through_gateway_and_stops_on_sigterm(tmp_path: Path):
    port, agent_port = free_port(), free_port()
    ready = re.compile(r"relayout up ready: gateway (http://\S+), agent (http://\S+)")
    p = procs.start(procs.CLI_MODULE, "up", "--port", str(port), "--agent-port", str(agent_port), "--data-dir",
                    str(tmp_path / "data"), env={"RELAYOUT_TOKEN": None}, ready=ready, timeout=150)
    try:
        assert p.match is not None
        gw, agent = p.match.group(1), p.match.group(2)
        assert gw == f"http://127.0.0.1:{port}" and agent == f"http://127.0.0.1:{agent_port}"

        client = OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="builtin:tiny", prompt="Hello", max_tokens=8, temperature=0, seed=1)
        assert r.choices[0].finish_reason == "length" and r.choices[0].text
        again = client.completions.create(model="builtin:tiny", prompt="Hello", max_tokens=8, temperature=0, seed=1)
        assert again.choices[0].text == r.choices[0].text

        kids = set(process_tree(p.pid)) - {p.pid}
        assert len(kids) >= 3, kids  # agent, gateway, replica (+ helpers)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, p.output()
        end = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [k for k in kids if alive(k)], p.output()
    finally:
        p.kill()
