"""Streaming sessions between replicas keeps the process in the middle (the migrator: the agent,
or `relayout migrate-replica`) at a bounded memory, whatever the KV size: it relays pieces, it
never holds a round."""

import json
import subprocess
import sys
import threading

import httpx
from relayout.migrate.procs import launch

# the bound we state: the migrator's peak RSS grows by less than this while moving ≥ 64 MiB
BOUND_MIB = 24

MIGRATOR = r"""
import json, resource, sys
from relayout.migrate.protocol.live import MigrationPlan, migrate_live
import httpx  # noqa: F401  (imports done before the baseline)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
res = migrate_live(sys.argv[1], sys.argv[2], plan=MigrationPlan(max_rounds=2, small_bytes=0))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_kib": peak - base, "bytes": res.bytes_total, "sessions": res.sessions}))
"""


def test_migrator_memory_stays_bounded_while_streaming_large_kv():
    args = ("serve", "--model", "builtin:bench", "--port", "0", "--kv-cache-mb", "200")
    src, dst = launch(*args), launch(*args)
    # 1100 tokens of builtin:bench = 69 MiB of KV (64 KiB per token)
    started = threading.Event()

    def client():  # a client that keeps reading its stream (an early close would abort the session)
        with httpx.stream("POST", f"{src.url}/v1/completions", timeout=300,
                          json={"prompt": [65 + i % 26 for i in range(1100)], "max_tokens": 400, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    started.set()  # prefilled and decoding: its KV is there to move

    reader = threading.Thread(target=client, daemon=True)
    try:
        reader.start()
        assert started.wait(300)
        out = subprocess.run([sys.executable, "-c", MIGRATOR, src.url, dst.url], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["sessions"] and res["bytes"] >= 64 * 2**20, res
        print("migrator peak RSS growth", res)
        assert res["grew_kib"] < BOUND_MIB * 1024, res
    finally:
        src.stop()
        dst.stop()
