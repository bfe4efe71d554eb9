"""Server-sent events as the completions and session-stream routes send them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

DONE = "[DONE]"


def sse_data(lines: Iterable[str]) -> Iterator[dict | str]:
    """Each `data:` payload in order, parsed: a JSON object, or DONE for the end marker (other lines,
    such as comments and blank separators, are skipped)."""
    for line in lines:
        if line.startswith("data: "):
            yield DONE if line == "data: [DONE]" else json.loads(line[6:])


def sse(lines: Iterable[str]) -> tuple[list[dict], bool]:
    """(the JSON events, whether the stream ended with [DONE])."""
    events: list[dict] = []
    done = False
    for ev in sse_data(lines):
        if ev == DONE:
            done = True
        else:
            assert isinstance(ev, dict)
            events.append(ev)
    return events, done


def token_ids(ev: dict) -> list[int]:
    """The token ids one event carries (`return_token_ids`), over its choices."""
    return [i for c in ev.get("choices", []) for i in c.get("token_ids") or []]
