"""The vLLM settings relayout refuses before vLLM starts (engine/vllm/args.py), in both spellings vLLM
takes (`--flag value`, `--flag=value`) and by their short aliases; what it lets through."""

from __future__ import annotations

import pytest
from relayout.engine.vllm.args import VllmArgsError, check_vllm_args


@pytest.mark.parametrize("args, named", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["-pp=2"], "-pp 2"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2"),
    (["-dp", "4"], "-dp 4"),
    (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address"),
    (["--decode-context-parallel-size", "2"], "--decode-context-parallel-size 2"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], "--speculative-config"),
    (["--spec-method=ngram"], "--spec-method"),
    (["--nnodes", "2"], "--nnodes 2"),
    (["--headless"], "--headless"),
    (["--kv-transfer-config", "{}"], "--kv-transfer-config"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--max-model-len", "2048", "-dp", "2"], "-dp 2"),
])
def test_settings_the_connector_cannot_move_are_refused_naming_the_flag(args, named):
    with pytest.raises(VllmArgsError) as e:
        check_vllm_args(args)
    assert named in str(e.value)


@pytest.mark.parametrize("args", [
    [], ["--max-model-len", "2048"], ["-pp", "1"], ["--data-parallel-size=1"], ["--kv-cache-dtype", "auto"],
    ["--enforce-eager", "--block-size", "32"], ["--nnodes", "1"],
])
def test_settings_it_can_move_under_pass(args):
    check_vllm_args(args)


def test_the_agent_answers_400_naming_the_flag_before_anything_starts():
    from relayout.agent.node.schema import EngineChoice
    from relayout.engine.web import HTTPError

    with pytest.raises(HTTPError) as e:
        EngineChoice(engine="vllm", vllm_args=["--max-model-len", "2048", "-pp", "2"]).checked_vllm_args()
    assert e.value.status == 400 and "-pp 2" in str(e.value)
