import os
from collections.abc import Iterator

import pytest
import torch
from relayout.engine.ranks.rank_channel import free_port

# Keep 2-core CI machines responsive; every test process is small.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("RELAYOUT_KV_BYTES", str(32 * 2**20))

# The process tier: test files that start replica, agent, gateway, rank or vLLM processes. They are
# marked `slow`, so `pytest -m "not slow"` runs the in-process tier alone (the README's command and
# .ci/run run both). A new file that starts processes belongs here.
PROCESS_TEST_FILES = {
    "test_agent",
    "test_bench_migration",
    "test_bf16_serving",
    "test_chat",
    "test_cli_plugins",
    "test_dashboard",
    "test_deploy",
    "test_direct_transfer",
    "test_drain",
    "test_dtypes",
    "test_faults",
    "test_fleet_controller",
    "test_frame_link",
    "test_gateway",
    "test_layouts",
    "test_logprobs",
    "test_malloc_arena",
    "test_migration",
    "test_migration_result",
    "test_mooncake_transport",
    "test_multinode",
    "test_netns",
    "test_policy",
    "test_procs",
    "test_protect",
    "test_reattach",
    "test_server",
    "test_staging",
    "test_status",
    "test_stream_memory",
    "test_tracing",
    "test_up",
    "test_vllm",
    "test_wheel",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in PROCESS_TEST_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Tiny random Qwen3-MoE (8 experts) and Mixtral written by transformers' save_pretrained."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(1234)
    q = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, eos_token_id=299,
                       max_position_embeddings=2048)
    mq = Qwen3MoeForCausalLM(q)
    _scale(mq)
    mq.save_pretrained(root / "qwen3moe")
    m = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                      eos_token_id=299, max_position_embeddings=2048)
    mm = MixtralForCausalLM(m)
    _scale(mm)
    mm.save_pretrained(root / "mixtral")
    return {"qwen3moe": root / "qwen3moe", "mixtral": root / "mixtral"}


def _scale(model):
    # HF's init (std 0.02) makes near-uniform logits; larger weights give decisive, varied tokens
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)


S3_BUCKET = "relayout-test"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server, reached over real HTTP on loopback."""
    from moto import server as moto_server

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture()
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    import boto3

    # exactly what a user would set: the standard boto3 variables, nothing in code
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    client = boto3.client("s3")
    if S3_BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=S3_BUCKET)
    return s3_endpoint
