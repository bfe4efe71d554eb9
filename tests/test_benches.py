"""Smoke tests: each bench runs at tiny sizes and returns its documented JSON keys (no timing gates)."""

import json

import pytest
from relayout.bench import overlap as bench_overlap
from relayout.bench import snapshot as bench_snapshot


def test_bench_snapshot_quick():
    res = bench_snapshot.run("builtin:tiny", quick=True, log=lambda _: None)
    json.dumps(res)  # the CLI prints it as one JSON line
    for k in ("memcpy_gbps", "snapshot_gbps", "restore_gbps"):
        assert res[k] > 0, k
    assert res["snapshot_vs_memcpy"] > 0
    by_dtype = res["codecs_by_dtype"]
    assert set(by_dtype) == {"float32", "bfloat16", "fp8_e4m3"}
    assert res["codecs"] == by_dtype["float32"] and res["codecs_bf16"] == by_dtype["bfloat16"]
    for table in by_dtype.values():
        assert set(table) == {"none", "zstd", "zstd-planes"}
        for v in table.values():
            assert v["ratio"] > 0 and v["gbps"] > 0
            assert v["encode_gbps"] >= v["gbps"] and v["decode_gbps"] >= v["gbps"]
        assert table["none"]["ratio"] == 1.0
    # each dtype's engine computed its own KV: bf16 is half of float32's bytes, fp8 a quarter plus its scales
    per = res["kv_bytes_per_token"]
    assert per["bfloat16"] * 2 == per["float32"] and per["float32"] // 4 < per["fp8_e4m3"] < per["bfloat16"]
    assert res["codec_chunks"] >= 1 and res["codec_sample_bytes"] > 0


def test_bench_overlap_quick():
    res = bench_overlap.run("builtin:tiny", quick=True, log=lambda _: None)
    json.dumps(res)
    assert 0.0 <= res["hidden_fraction"] <= 1.0
    assert res["tokens_match"] is True
    assert res["cases"] and res["hidden_fraction_case"]
    for c in res["cases"]:
        assert 0.0 <= c["hidden_fraction"] <= 1.0
        assert c["tokens_match"] is True
        assert c["decode_steps"] > 0 and c["off_total_ms"] > 0 and c["on_exposed_ms"] >= 0


def test_bench_engine_bfloat16_tiny():
    from relayout.bench import engine as bench_engine

    res = bench_engine.run("builtin:tiny", new_tokens=3, prompt_len=[4, 8], reps=1, log=lambda _: None,
                           dtype="bfloat16")
    json.dumps(res)
    assert res["dtype"] == "bfloat16" and res["prompt_len"] == 8
    assert set(res["by_prompt_len"]) == {"4", "8"}
    assert res["preemptions"] == 0 and res["kv_blocks"] > 0  # no session prefilled again inside the timed span
    for b in bench_engine.BATCHES:
        assert res[f"ours_tps_batch{b}"] > 0 and res[f"hf_tps_batch{b}"] > 0
        assert res[f"speedup_batch{b}"] > 0
        assert 0.0 <= res[f"same_tokens_batch{b}"] <= 1.0


def test_replication_bench_splits_cpus_like_two_hosts() -> None:
    """`bench replication --hosts split`: the source gets the first half of the CPUs, the standby and
    the clients the rest; one CPU cannot be split (both get it)."""
    import pytest
    from relayout.bench.replica_client import split_cpus
    from relayout.bench.replication import run

    assert split_cpus({0, 1}) == ({0}, {1})
    assert split_cpus({2, 3, 5, 7}) == ({2, 3}, {5, 7})
    assert split_cpus({4}) == ({4}, {4})
    with pytest.raises(ValueError, match="hosts must be"):
        run(hosts="both")


def test_bench_datapath_moves_a_round_into_tp_pools_and_reports_both_sides() -> None:
    """`bench datapath`: the in-place send and the placed receive of a cold round, beside a bare copy;
    run() raises if the KV that arrived in the target's pools differs from the source's."""
    from relayout.bench import datapath

    res = datapath.run(tokens=600, split=[3, 5], reps=1)
    assert res["placed_chunks"] == res["chunks"] == 2 * datapath.LAYERS  # [0, 512) and [512, 600)
    assert res["bytes"] > 600 * datapath.LAYERS * datapath.HEADS * datapath.HEAD_DIM * 4 * 2
    for key in ("sender_cpu_s_per_gb", "receiver_cpu_s_per_gb", "bare_cpu_s_per_gb", "gbps", "bare_gbps"):
        assert res[key] > 0, key
    assert abs(res["cpu_s_per_gb"] - res["sender_cpu_s_per_gb"] - res["receiver_cpu_s_per_gb"]) < 0.002
    # the floor: the same bytes hashed at both ends and copied into the pools, beside the path
    assert res["floor_sender_cpu_s_per_gb"] > 0 and res["floor_receiver_cpu_s_per_gb"] > 0
    assert res["cpu_vs_floor"] == pytest.approx(res["cpu_s_per_gb"] / res["floor_cpu_s_per_gb"], rel=0.02)
    with pytest.raises(ValueError, match="split"):
        datapath.run(tokens=64, split=[4, 3], reps=1)
