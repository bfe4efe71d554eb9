"""The process kit of the fault matrix (tests/test_faults.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from relayout.engine.ranks.rank_channel import free_port
from relayout.migrate.procs import kill_tree as kill_tree  # the tests kill -9 with it
from relayout.migrate.procs import replica

from tests.helpers.proxy import Proxy


@contextmanager
def fault_kit(tmp: Path, ttl: float) -> Iterator[dict]:
    """Replicas (source, target, and the ones each kill test takes down), moto S3 behind a
    killable proxy, and a tiny tmpfs that fills up; everything stopped and removed afterwards."""
    full = Path(tempfile.mkdtemp(prefix="relayout-full-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(full)],
                             capture_output=True).returncode == 0
    env = {"RELAYOUT_TRANSFER_TTL_S": str(ttl), "RELAYOUT_DATA_DIR": str(tmp),
           "RELAYOUT_FILE_ROOTS": os.pathsep.join([str(tmp), str(full)])}
    # moto S3 as its own process (so it can be killed), reached through a proxy that fires the kill
    moto_port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s3proxy = Proxy(moto_port)
    s3env = {"AWS_ENDPOINT_URL": s3proxy.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard"}
    pool = ThreadPoolExecutor(8)
    specs = {
        "a": (None, {**env, **s3env}),  # the source of most tests
        "b": (None, env),  # the target of most tests
        "t_pre": ("attn_tp=2", env),  # killed in pre-copy (two ranks: they must die with it)
        "t_stop": (None, env),  # killed in stop-and-copy
        "t_rank": ("attn_tp=2", env),  # loses a rank mid-transfer
        "s_commit": (None, env),  # source killed right after the commit
    }
    futs = {k: pool.submit(replica, *v) for k, v in specs.items()}
    procs = {}
    try:
        for k, f in futs.items():
            procs[k] = f.result()
        yield {"procs": procs, "tmp": tmp, "full": full if mounted else None, "moto": moto,
               "moto_port": moto_port, "s3proxy": s3proxy, "s3env": s3env, "env": env}
    finally:
        for f in futs.values():
            try:
                f.result().stop()
            except Exception:  # noqa: BLE001
                pass
        pool.shutdown()
        s3proxy.close()
        if moto.poll() is None:
            moto.kill()
        if mounted:
            subprocess.run(["umount", str(full)], capture_output=True)
        shutil.rmtree(full, ignore_errors=True)


