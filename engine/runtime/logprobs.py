"""Per-token log probabilities: computed on the driver from the logits the step already brought
back, stored in the session's state (so they survive checkpoints and moves), and shaped the way
OpenAI's two APIs return them.

The values are `log_softmax` of the model's raw logits, before temperature, top-k and top-p
(vLLM's default, "raw logprobs"): they describe the model, not the sampler's reshaped
distribution, so a greedy and a sampled run report the same numbers for the same prefix.
"""

from __future__ import annotations

from typing import Any

import torch
from relayout.engine.model.tokenizer import BYTE_SPECIALS, ByteTokenizer, Tokenizer

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (chat) and logprobs (completions)

# One generated token's record, as kept in SessionState.logprobs (plain lists: JSON in checkpoints):
# [logprob of the chosen token, ids of the k most likely tokens, their logprobs]
LogprobRecord = list


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> LogprobRecord:
    """The record for `token` sampled from last-position `logits` [vocab]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    if k <= 0:
        return [float(lp[token]), [], []]
    vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
    return [float(lp[token]), ids.tolist(), vals.tolist()]


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id])


def token_bytes(tok: Tokenizer, token_id: int) -> list[int]:
    """The token's bytes: exact for the byte tokenizer (one byte of a split character too),
    else the UTF-8 of its decoded text."""
    if isinstance(tok, ByteTokenizer):
        return [token_id] if 0 <= token_id < BYTE_SPECIALS else []
    return list(token_text(tok, token_id).encode("utf-8"))


class CompletionLogprobs:
    """The legacy `/v1/completions` shape, `{tokens, token_logprobs, top_logprobs, text_offset}`,
    a batch of tokens at a time. `text_offset` counts characters of the generated text (the
    token strings' lengths summed, as vLLM does), so it depends only on the ids: a resumed
    stream replays the ids already sent through `skip`."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.offset = 0

    def skip(self, ids: list[int]) -> None:
        self.offset += sum(len(token_text(self.tok, t)) for t in ids)

    def add(self, ids: list[int], records: list[LogprobRecord]) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (chosen, top_ids, top_lps) in zip(ids, records, strict=True):
            text = token_text(self.tok, t)
            out["tokens"].append(text)
            out["token_logprobs"].append(chosen)
            # the chosen token and the k most likely (OpenAI: "up to logprobs+1 elements"); where two
            # ids decode to the same string the chosen one, then the likelier, keeps the key
            top: dict[str, float] = {}
            for i, v in zip(top_ids, top_lps, strict=True):
                key = token_text(self.tok, i)
                top.setdefault(key, chosen if key == text else v)
            top.setdefault(text, chosen)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(tok: Tokenizer, ids: list[int], records: list[LogprobRecord]) -> dict[str, Any]:
    """The chat shape: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`."""
    content = []
    for t, (chosen, top_ids, top_lps) in zip(ids, records, strict=True):
        content.append({
            "token": token_text(tok, t), "logprob": chosen, "bytes": token_bytes(tok, t),
            "top_logprobs": [{"token": token_text(tok, i), "logprob": v, "bytes": token_bytes(tok, i)}
                             for i, v in zip(top_ids, top_lps, strict=True)],
        })
    return {"content": content}
