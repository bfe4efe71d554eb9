"""`relayout up`: agent + one builtin:tiny replica + gateway; a completion through the gateway with the
openai client; SIGTERM stops everything (exit 0, no process left behind)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from openai import OpenAI
from relayout.migrate.procs import alive, process_tree

from tests.conftest import _free_port


def test_up_serves_through_gateway_and_stops_on_sigterm(tmp_path: Path):
    port, agent_port = _free_port(), _free_port()
    exe = Path(sys.executable).with_name("relayout")
    env = {k: v for k, v in os.environ.items() if k != "RELAYOUT_TOKEN"}
    p = subprocess.Popen([str(exe), "up", "--port", str(port), "--agent-port", str(agent_port),
                          "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=dict(env, PYTHONUNBUFFERED="1"))
    out: list[str] = []
    try:
        ready = None
        end = time.monotonic() + 150
        while time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                break
            out.append(line)
            ready = re.search(r"relayout up ready: gateway (http://\S+), agent (http://\S+)", line)
            if ready:
                break
        assert ready, "".join(out)
        threading.Thread(target=lambda: out.extend(p.stdout), daemon=True).start()
        gw, agent = ready.group(1), ready.group(2)
        assert gw == f"http://127.0.0.1:{port}" and agent == f"http://127.0.0.1:{agent_port}"

        client = OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="builtin:tiny", prompt="Hello", max_tokens=8, temperature=0, seed=1)
        assert r.choices[0].finish_reason == "length" and r.choices[0].text
        again = client.completions.create(model="builtin:tiny", prompt="Hello", max_tokens=8, temperature=0, seed=1)
        assert again.choices[0].text == r.choices[0].text

        kids = set(process_tree(p.pid)) - {p.pid}
        assert len(kids) >= 3, kids  # agent, gateway, replica (+ helpers)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, "".join(out)
        end = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [k for k in kids if alive(k)], "".join(out)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
