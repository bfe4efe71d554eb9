"""A round's buffers, allocated on one thread and freed on another, are reused by the next round
rather than page-faulted in anew (storage.format.chunks.one_malloc_arena + keep_freed_memory), as a
replica and its ranks set them up. Run in a fresh process: mallopt is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from relayout.storage.format import chunks

pytestmark = pytest.mark.skipif(chunks._mallopt is None or not sys.platform.startswith("linux"),
                                reason="glibc's mallopt on Linux only")

ROUND = """
import json, resource, sys, threading
from relayout.storage.format.chunks import keep_freed_memory, new_buffer, one_malloc_arena

arena = one_malloc_arena()
N, SIZE = 128, 2 << 20  # a 256 MiB round of 2 MiB chunks, as a link reader receives them
PAGES = N * SIZE // 4096
keep_freed_memory(N * SIZE)

def receive(out):  # a link reader: a thread of its own per round
    for _ in range(N):
        b = new_buffer(SIZE)
        b[::4096] = bytes(SIZE // 4096)  # every page written, as recv_into does
        out.append(b)

faults = []
for _ in range(3):
    bufs = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = threading.Thread(target=receive, args=(bufs,))
    t.start(); t.join()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    bufs.clear()  # imported: freed on this (the engine's) thread
print(json.dumps({"arena": arena, "faults": faults, "pages": PAGES}))
"""


def test_freed_round_buffers_are_reused_by_the_next_round():
    out = subprocess.run([sys.executable, "-c", ROUND], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["arena"] is True
    first, *later = res["faults"]
    assert first >= res["pages"] // 2, res  # the first round touches fresh memory (the test measures faults)
    for n in later:  # the next rounds, each on a new thread, land in the pages the last one freed
        assert n < res["pages"] // 20, res
