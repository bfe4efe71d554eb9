"""`relayout demo`: the one thing relayout exists for, in a terminal. An agent, two replicas of the
embedded default (one rank, then a 2-rank data/expert-parallel layout) and a gateway start here; a
story streams through the gateway (the openai client when it is installed); mid-stream the agent
re-lays the session out onto the other layout; the text keeps arriving, the moment of the move is
marked with the stall it cost, and at the end the text is checked against an undisturbed run of the
same request. Ctrl-C stops everything it started."""

from __future__ import annotations

import json
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from relayout.agent.commands.up import _start_child, _stop_child
from relayout.engine import web
from relayout.migrate import procs

MODEL = "builtin:tiny"
SOURCE_LAYOUT = "attn_dp=1"
TARGET_LAYOUT = "attn_dp=2,moe_ep=2"
PROMPT = "Once upon a time"
MOVE_AFTER = 48  # tokens the client has before the move is asked for


@dataclass
class DemoResult:
    text: str = ""
    tokens: int = 0  # text pieces the stream brought (a piece holds a token's text, or more)
    moved_at: int | None = None  # the client's piece count when the move committed
    stall_ms: float | None = None  # the session's pause (the agent's operation figure)
    identical: bool | None = None
    reference: str = ""
    reference_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def _stream(gateway: str, body: dict) -> Iterator[str]:
    """The story's text pieces as they arrive: the openai client when installed, else plain SSE."""
    try:
        from openai import OpenAI
    except ImportError:
        OpenAI = None  # noqa: N806 - the class, when the package is there
    body = dict(body)
    if OpenAI is not None:
        client = OpenAI(base_url=f"{gateway}/v1", api_key="demo")
        extra = {k: body.pop(k) for k in ("ignore_eos",) if k in body}
        for chunk in client.completions.create(stream=True, extra_body=extra, **body):
            if chunk.choices:
                yield chunk.choices[0].text
        return
    with httpx.stream("POST", f"{gateway}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])["choices"][0]["text"]


def run_demo(write: Callable[[str], None], log: Callable[[str], None], max_tokens: int = 1200,
             data_dir: Path | None = None) -> DemoResult:
    """Start the parts, stream, move, check; stop everything it started (also on Ctrl-C)."""
    import threading

    hdr = web.bearer_headers(web.env_token())
    res = DemoResult()
    parts: list[procs.Proc] = []
    tmp = tempfile.TemporaryDirectory(prefix="relayout-demo-") if data_dir is None else None
    root = Path(tmp.name) if tmp else Path(data_dir)  # type: ignore[arg-type]
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt, then cleanup
    try:
        log(f"starting an agent, two {MODEL} replicas ({SOURCE_LAYOUT}; {TARGET_LAYOUT}) and a gateway")
        agent = _start_child(procs.agent, "--port", "0", "--data-dir", str(root / "agent"), what="agent")
        parts.append(agent)
        reps = []
        for layout in (SOURCE_LAYOUT, TARGET_LAYOUT):
            r = httpx.post(f"{agent.url}/v1/replicas", headers=hdr, timeout=300, json={"model": MODEL, "layout": layout})
            if r.status_code != 201:
                raise RuntimeError(f"the agent could not launch a {layout} replica: {web.error_message(r)}")
            reps.append(r.json()["id"])
        gateway = _start_child(procs.gateway, "--agent", agent.url, "--port", "0", what="gateway")
        parts.append(gateway)
        # the story runs its whole length (past an end of text: stories follow one another), so it is still
        # being written when the move comes
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        # the yardstick: the same request, undisturbed (on a replica the gateway picks)
        ref = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=300)
        ref.raise_for_status()
        res.reference = ref.json()["choices"][0]["text"]
        res.reference_tokens = int(ref.json()["usage"]["completion_tokens"])
        log(f"streaming a story from the {SOURCE_LAYOUT} replica; after {MOVE_AFTER} tokens it moves to "
            f"{TARGET_LAYOUT}\n")
        op: dict = {}

        def move() -> None:
            r = httpx.post(f"{agent.url}/v1/replicas/{reps[0]}/migrate", headers=hdr, timeout=60,
                           json={"target": {"agent": agent.url, "replica": reps[1]}})
            if r.status_code != 202:
                res.errors.append(f"the move was refused: {web.error_message(r)}")
                return
            oid = r.json()["operation_id"]
            while True:
                o = httpx.get(f"{agent.url}/v1/operations/{oid}", headers=hdr, timeout=30).json()
                if o["state"] in ("succeeded", "failed", "aborted"):
                    op.update(o)
                    res.moved_at = res.tokens
                    return
                time.sleep(0.02)

        mover = threading.Thread(target=move, daemon=True)
        write(PROMPT)
        for piece in _stream(gateway.url, body):
            res.text += piece
            res.tokens += 1
            write(piece)
            if res.tokens == MOVE_AFTER:
                mover.start()
            if op and res.moved_at is not None and "marked" not in op:
                op["marked"] = True
                res.stall_ms = round(op["stall_ms"], 1) if op.get("stall_ms") is not None else None
                write(f"\x1b[1;35m⟦moved to {TARGET_LAYOUT}: {op['state']}, stall "
                      f"{res.stall_ms if res.stall_ms is not None else '?'} ms⟧\x1b[0m")
        if mover.is_alive():
            mover.join(60)
        if op.get("state") != "succeeded":
            res.errors.append(f"the move did not succeed: {op.get('error') or op.get('state') or 'not started'}")
        res.identical = res.text == res.reference
        return res
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        for p in reversed(parts):
            _stop_child(p, 30)
        signal.signal(signal.SIGINT, old)
        if tmp is not None:
            tmp.cleanup()
