"""Each replica its own accelerators (agent/node/devices.py): dealt from the node's free set for the
layout's world size, refused (409) naming need and have, freed when the replica stops. The node's
device list is injected (`RELAYOUT_DEVICES`): this machine has none."""

from __future__ import annotations

import httpx
import pytest
from relayout.agent.node.devices import plan_devices
from relayout.agent.node.registry import ReplicaRecord
from relayout.engine.web import HTTPError

from tests.helpers.agents import TOKEN, H, start_agent, stop

NODE = [str(i) for i in range(8)]


def test_two_tp4_replicas_share_an_8_gpu_node_and_a_third_is_refused_naming_need_and_have():
    records: list[ReplicaRecord] = []
    for engine in ("vllm", "builtin"):
        plan = plan_devices(NODE, records, 4, engine, ["--max-model-len", "2048"])
        records.append(ReplicaRecord(f"r{len(records)}", "m", engine, status="running", devices=plan.devices))
    assert [r.devices for r in records] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    first = plan_devices(NODE, [], 4, "vllm", None)
    assert first.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert first.vllm_args == ["--gpu-memory-utilization", "0.9"]  # the devices are its own
    assert plan_devices(NODE, [], 4, "vllm", ["--gpu-memory-utilization=0.5"]).vllm_args == []  # the user's share
    assert plan_devices(NODE, [], 4, "builtin", None).vllm_args == []
    with pytest.raises(HTTPError) as e:
        plan_devices(NODE, records, 1, "vllm", None)
    assert e.value.status == 409 and "needs 1 device(s); 0 of the node's 8 are free" in str(e.value)
    records[0].status = "stopped"  # a stopped (or dead) replica's devices are free again
    assert plan_devices(NODE, records, 2, "builtin", None).devices == ["0", "1"]
    assert plan_devices([], records, 8, "vllm", None).devices == []  # no devices on the node: none dealt


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


@pytest.mark.slow
def test_the_agent_deals_each_replica_its_devices_and_frees_them(tmp_path):
    mp = pytest.MonkeyPatch()
    mp.setenv("RELAYOUT_TOKEN", TOKEN)
    mp.setenv("RELAYOUT_DEVICES", "0,1")
    p, url = start_agent(tmp_path / "a", tmp_path / "a.log")
    try:
        got = []
        for _ in range(2):
            r = httpx.post(f"{url}/v1/replicas", headers=H, json={"model": "builtin:tiny"}, timeout=200)
            assert r.status_code == 201, r.text
            rec = httpx.get(f"{url}/v1/replicas/{r.json()['id']}", headers=H, timeout=30).json()
            assert _environ(rec["pid"])["CUDA_VISIBLE_DEVICES"] == ",".join(rec["devices"])
            got.append(rec)
        assert sorted(d for rec in got for d in rec["devices"]) == ["0", "1"]
        r = httpx.post(f"{url}/v1/replicas", headers=H, json={"model": "builtin:tiny"}, timeout=60)
        assert r.status_code == 409 and "needs 1 device(s); 0 of the node's 2 are free" in r.text, r.text
        assert httpx.delete(f"{url}/v1/replicas/{got[0]['id']}", headers=H, timeout=60).status_code in (200, 204)
        r = httpx.post(f"{url}/v1/replicas", headers=H, json={"model": "builtin:tiny"}, timeout=200)
        assert r.status_code == 201, r.text
        rec = httpx.get(f"{url}/v1/replicas/{r.json()['id']}", headers=H, timeout=30).json()
        assert rec["devices"] == got[0]["devices"]
    finally:
        stop(p)
        mp.undo()
