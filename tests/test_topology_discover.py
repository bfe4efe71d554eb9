"""migrate.placement.topology.discover() parsing NVML answers, with a fake pynvml module (no GPU needed)."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
from relayout.migrate.placement import topology as T


class NVMLError(Exception):
    pass


class FakeNVML:
    """pynvml's API over a dict: gpus[i] = {bus, mem, procs, links: [(version, remote bus)], pcie: (gen, width)};
    `ancestor(i, j)` gives nvmlDeviceGetTopologyCommonAncestor's level."""

    NVML_FEATURE_ENABLED = 1
    NVML_FEATURE_DISABLED = 0

    def __init__(self, gpus, ancestor=lambda i, j: 50, init_error=None):
        self.gpus, self.ancestor, self.init_error = gpus, ancestor, init_error
        self.inited = self.shut = 0

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error
        self.inited += 1

    def nvmlShutdown(self):
        self.shut += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.gpus[h]["bus"].upper().encode())

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.gpus[h]["mem"], used=0, free=self.gpus[h]["mem"])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=1) for p in self.gpus[h].get("procs", [])]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        raise NVMLError("Not Supported")

    def _link(self, h, link):
        links = self.gpus[h].get("links", [])
        if link >= len(links):
            raise NVMLError("Not Supported")
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._link(h, link)
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self._link(h, link)[0]

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h, link):
        return SimpleNamespace(busId=self._link(h, link)[1])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.gpus[h].get("pcie", (5, 16))[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.gpus[h].get("pcie", (5, 16))[1]

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor(a, b)


def hgx8():
    """8 H100s on 4 NVSwitches (18 NVLink4 links each); GPU 5 busy; PCIe switches pair GPUs (0,1) (2,3)…"""
    switches = [f"00000000:{0xa0 + s:02x}:00.0" for s in range(4)]
    gpus = []
    for i in range(8):
        links = [(4, switches[k % 4]) for k in range(18)]
        gpus.append({"bus": f"00000000:{0x18 + 16 * i:02x}:00.0", "mem": 85_520_809_984, "links": links,
                     "procs": [4242] if i == 5 else []})
    return FakeNVML(gpus, ancestor=lambda a, b: 20 if a // 2 == b // 2 else 40)


def test_hgx_box():
    nv = hgx8()
    topo = T.discover(nvml=nv, node_name="box", network_gbps=50)
    assert topo is not None and T.last_discover_reason == ""
    assert nv.inited == 1 and nv.shut == 1
    (node,) = topo.nodes
    assert node.name == "box" and node.network_gbps == 50
    assert node.nvlink_domain_gbps == 18 * 25.0
    assert node.pcie_gbps == pytest.approx(3.938 * 16)
    ds = topo.devices()
    assert [d.id for d in ds] == [f"box/gpu{i}" for i in range(8)]
    assert all(d.memory_gb == 85.5 for d in ds)
    assert [d.free for d in ds] == [i != 5 for i in range(8)]
    assert {d.nvlink_domain for d in ds} == {"nvl0"}
    assert [d.pcie_switch for d in ds] == ["sw0", "sw0", "sw1", "sw1", "sw2", "sw2", "sw3", "sw3"]
    assert topo.bandwidth("box/gpu0", "box/gpu7") == 450.0


def test_mixed_box_direct_links_and_plain_pcie():
    """GPUs 0-1 bridged by 4 direct NVLink3 links, GPUs 2-3 PCIe only (gen 4 x16, one gen 3 x8)."""
    bus = [f"00000000:{b:02x}:00.0" for b in (0x3b, 0x5e, 0x86, 0xaf)]
    gpus = [
        {"bus": bus[0], "mem": 40e9, "links": [(3, bus[1].upper())] * 4, "pcie": (4, 16)},
        {"bus": bus[1], "mem": 40e9, "links": [(3, bus[0])] * 4, "pcie": (4, 16)},
        {"bus": bus[2], "mem": 24e9, "pcie": (4, 16)},
        {"bus": bus[3], "mem": 24e9, "pcie": (3, 8)},
    ]
    topo = T.discover(nvml=FakeNVML(gpus), node_name="ws")
    ds = topo.devices()
    assert [d.nvlink_domain for d in ds] == ["nvl0", "nvl0", None, None]
    assert topo.nodes[0].nvlink_domain_gbps == 100.0
    assert topo.nodes[0].pcie_gbps == pytest.approx(0.985 * 8)
    assert topo.nodes[0].network_gbps == T.DEFAULT_NETWORK_GBPS
    assert all(d.pcie_switch is None for d in ds)  # ancestors across host bridges only
    assert topo.bandwidth("ws/gpu0", "ws/gpu1") == 100.0
    assert topo.bandwidth("ws/gpu0", "ws/gpu2") == topo.nodes[0].pcie_gbps
    assert [d.memory_gb for d in ds] == [40.0, 40.0, 24.0, 24.0]


def test_two_separate_nvlink_pairs():
    bus = [f"00000000:{b:02x}:00.0" for b in (1, 2, 3, 4)]
    pair = {0: 1, 1: 0, 2: 3, 3: 2}
    gpus = [{"bus": bus[i], "mem": 80e9, "links": [(4, bus[pair[i]])] * 2} for i in range(4)]
    topo = T.discover(nvml=FakeNVML(gpus), node_name="n")
    assert [d.nvlink_domain for d in topo.devices()] == ["nvl0", "nvl0", "nvl1", "nvl1"]
    assert topo.bandwidth("n/gpu0", "n/gpu1") == 50.0
    assert topo.bandwidth("n/gpu1", "n/gpu2") == topo.nodes[0].pcie_gbps


def test_no_nvml_no_driver_no_gpu(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="relayout.migrate.placement.topology")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert T.discover() is None
    assert "nvidia-ml-py is not installed" in T.last_discover_reason
    assert "topology file" in caplog.text
    assert T.discover(nvml=FakeNVML([], init_error=NVMLError("Driver Not Loaded"))) is None
    assert "Driver Not Loaded" in T.last_discover_reason
    nv = FakeNVML([])
    assert T.discover(nvml=nv) is None and "no GPU" in T.last_discover_reason and nv.shut == 1


def test_broken_answer_is_a_reason_not_a_crash():
    nv = FakeNVML([{"bus": "0:1:0.0", "mem": -5}])  # memory_gb must be > 0
    assert T.discover(nvml=nv) is None
    assert "NVML discovery failed" in T.last_discover_reason
