"""The vLLM settings relayout's connector cannot move sessions under, refused before vLLM starts
(by `relayout serve --engine vllm` and by the agent, which answers 400): each named with why. No
vLLM and no torch import here: the agent checks a body without either."""

from __future__ import annotations

__all__ = ["VllmArgsError", "check_vllm_args"]


class VllmArgsError(ValueError):
    """A vLLM setting relayout's connector cannot move sessions under; the message names the flag."""


# flag (and its aliases) -> why relayout refuses it, unless its value is one of the allowed
_REFUSED: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("--pipeline-parallel-size", "-pp"), ("1",), "pipeline parallelism splits a request's KV across stages the "
                                                   "connector does not see"),
    (("--data-parallel-size", "-dp"), ("1",), "a data-parallel vLLM is several engines; run one relayout replica "
                                               "per data-parallel rank"),
    (("--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr", "--data-parallel-size-local", "-dpl",
      "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp", "--data-parallel-backend", "-dpb",
      "--data-parallel-hybrid-lb", "-dph", "--data-parallel-external-lb", "-dpe",
      "--data-parallel-multi-port-external-lb", "-dpm"), (), "data parallelism is not supported by relayout's "
                                                            "connector"),
    (("--decode-context-parallel-size", "-dcp", "--prefill-context-parallel-size", "-pcp"), ("1",),
     "context parallelism interleaves a request's KV across ranks"),
    (("--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens"), (),
     "speculative decoding keeps a drafter's KV the connector does not move"),
    (("--nnodes", "-n"), ("1",), "multi-node tensor parallelism: run vLLM on one node per replica"),
    (("--node-rank", "-r", "--master-addr", "--master-port", "--headless"), (),
     "multi-node tensor parallelism: run vLLM on one node per replica"),
    (("--kv-transfer-config",), (), "relayout loads its own KV connector; vLLM takes one"),
    (("--kv-connector",), (), "relayout loads its own KV connector; vLLM takes one"),
    (("--kv-cache-dtype",), ("auto",), "relayout moves KV of the model's dtype; an fp8 cache's scales are not "
                                       "moved, so it is refused rather than cast"),
    (("--tensor-parallel-size", "-tp"), (), "the replica's layout sets it (--layout attn_tp=N)"),
]


def check_vllm_args(args: list[str]) -> None:
    """VllmArgsError naming the first flag relayout cannot move sessions under (before vLLM starts)."""
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if not flag.startswith("-"):
            continue
        for names, allowed, why in _REFUSED:
            if flag not in names:
                continue
            value = val if eq else (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "")
            if allowed and value in allowed:
                continue
            shown = f"{flag} {value}".strip() if allowed else flag
            raise VllmArgsError(f"vLLM setting {shown} is refused: {why}")
