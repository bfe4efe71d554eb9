"""Fleet topology: nodes, their devices, and the bandwidth between any two devices.

Bandwidths are in GB/s. Two devices on one node in the same NVLink domain talk at the
node's `nvlink_domain_gbps`; on one node without a shared NVLink domain they go over
PCIe (`pcie_gbps`); on different nodes over the network, limited by the slower NIC.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator


class TopologyError(ValueError):
    pass


class Device(BaseModel):
    id: str
    node: str = ""  # filled from the enclosing node when omitted
    index: int = 0
    memory_gb: float = Field(gt=0)
    free: bool = True
    pcie_switch: str | None = None
    # devices of one node sharing an NVLink domain; None = this device has no NVLink
    nvlink_domain: str | None = "nvl0"


class Node(BaseModel):
    name: str
    devices: list[Device]
    nvlink_domain_gbps: float = Field(default=0.0, ge=0)  # 0 = no NVLink on this node
    network_gbps: float = Field(gt=0)
    pcie_gbps: float = Field(default=25.0, gt=0)

    @model_validator(mode="after")
    def _own_devices(self) -> Node:
        for i, d in enumerate(self.devices):
            if d.node and d.node != self.name:
                raise ValueError(f"device {d.id} says node {d.node!r} but is listed under node {self.name!r}")
            d.node = self.name
            if "index" not in d.model_fields_set:
                d.index = i
        return self


class Topology(BaseModel):
    nodes: list[Node]

    @model_validator(mode="after")
    def _unique(self) -> Topology:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate node names in {names}")
        ids = [d.id for d in self.devices()]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate device ids {dup}")
        return self

    # ---- loading -----------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise TopologyError(f"invalid topology: {msgs}") from None

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        p = Path(path)
        if not p.is_file():
            raise TopologyError(f"{p}: no such topology file")
        text = p.read_text()
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise TopologyError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
        if not isinstance(data, dict):
            raise TopologyError(f"{p}: expected a mapping with a 'nodes' list")
        return cls.from_dict(data)

    @classmethod
    def uniform(cls, nodes: int, devices_per_node: int, *, memory_gb: float = 80.0, nvlink_gbps: float = 450.0,
                network_gbps: float = 50.0, free: bool = True) -> Topology:
        """A homogeneous fleet, handy for tests and benchmarks."""
        return cls(nodes=[
            Node(name=f"n{i}", nvlink_domain_gbps=nvlink_gbps, network_gbps=network_gbps,
                 devices=[Device(id=f"n{i}/gpu{j}", index=j, memory_gb=memory_gb, free=free)
                          for j in range(devices_per_node)])
            for i in range(nodes)])

    # ---- queries -----------------------------------------------------------
    def devices(self) -> list[Device]:
        return [d for n in self.nodes for d in n.devices]

    def device(self, device_id: str) -> Device:
        for d in self.devices():
            if d.id == device_id:
                return d
        raise TopologyError(f"unknown device {device_id!r}")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise TopologyError(f"unknown node {name!r}")

    def bandwidth(self, a: str | Device, b: str | Device) -> float:
        da = a if isinstance(a, Device) else self.device(a)
        db = b if isinstance(b, Device) else self.device(b)
        if da.id == db.id:
            return float("inf")
        na, nb = self.node(da.node), self.node(db.node)
        if na.name != nb.name:
            return min(na.network_gbps, nb.network_gbps)
        if da.nvlink_domain is not None and da.nvlink_domain == db.nvlink_domain and na.nvlink_domain_gbps > 0:
            return na.nvlink_domain_gbps
        return na.pcie_gbps


# ---- local discovery (NVML) ------------------------------------------------------------------------
log = logging.getLogger(__name__)

# per-link, per-direction GB/s by NVLink version (NVLink 2-4: 25 GB/s, NVLink 5: 50 GB/s)
NVLINK_LINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
NVLINK_MAX_LINKS = 18
# per-lane, per-direction GB/s after encoding, by PCIe generation
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
TOPOLOGY_MULTIPLE = 20  # NVML_TOPOLOGY_MULTIPLE: behind PCIe switches only, no host bridge between
DEFAULT_NETWORK_GBPS = 25.0  # NVML does not see NICs; a 200 Gb/s NIC is 25 GB/s

last_discover_reason = ""  # why the last discover() returned None ("" when it found devices)


def _bus_id(pci) -> str:
    b = getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", "")
    if isinstance(b, bytes):
        b = b.decode(errors="replace")
    return str(b).strip("\x00").lower()


def _call(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: that feature is absent
        return default


class _Union:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def topology_from_nvml(nvml, node_name: str | None = None, network_gbps: float = DEFAULT_NETWORK_GBPS) -> Topology:
    """This machine as a one-node Topology, read through an initialised NVML module (pynvml's API).

    - devices: one per GPU, `memory_gb` its total memory (GB, 1e9 bytes), `free` when no compute
      or graphics process runs on it;
    - NVLink: GPUs joined by active links (directly, or through the same NVSwitch, seen as the
      same remote PCI bus id) share an `nvlink_domain`; a GPU without an active link has none.
      The node's `nvlink_domain_gbps` is the smallest per-GPU sum of active links × per-link
      rate in any domain;
    - PCIe: GPUs whose common ancestor is a PCIe switch (NVML_TOPOLOGY_MULTIPLE or closer) share
      a `pcie_switch`; `pcie_gbps` is the slowest GPU's max generation × max width.
    """
    name = node_name or socket.gethostname()
    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    buses = [_bus_id(nvml.nvmlDeviceGetPciInfo(h)) for h in handles]
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    remote = getattr(nvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or getattr(
        nvml, "nvmlDeviceGetNvLinkRemotePciInfo", None)
    nvl = _Union()
    link_gbps = [0.0] * count
    for i, h in enumerate(handles):
        for link in range(NVLINK_MAX_LINKS):
            if _call(nvml.nvmlDeviceGetNvLinkState, h, link) != enabled:
                continue
            ver = _call(nvml.nvmlDeviceGetNvLinkVersion, h, link, default=4)
            link_gbps[i] += NVLINK_LINK_GBPS.get(int(ver), 25.0)
            peer = _call(remote, h, link) if remote is not None else None
            nvl.join("gpu:" + buses[i], "bus:" + (_bus_id(peer) if peer is not None else f"?{i}.{link}"))
    # a remote id that is another GPU's own bus id is that GPU
    for b in buses:
        if ("bus:" + b) in nvl.parent:
            nvl.join("gpu:" + b, "bus:" + b)
    domains: dict[str, str] = {}
    nvl_name: list[str | None] = []
    for i, b in enumerate(buses):
        if link_gbps[i] == 0:
            nvl_name.append(None)
            continue
        root = nvl.find("gpu:" + b)
        nvl_name.append(domains.setdefault(root, f"nvl{len(domains)}"))
    sw = _Union()
    level_fn = getattr(nvml, "nvmlDeviceGetTopologyCommonAncestor", None)
    for i in range(count):
        sw.find(str(i))
        for j in range(i + 1, count):
            lvl = _call(level_fn, handles[i], handles[j]) if level_fn is not None else None
            if lvl is not None and int(lvl) <= TOPOLOGY_MULTIPLE:
                sw.join(str(i), str(j))
    switch_names: dict[str, str] = {}
    pcie = []
    devices = []
    for i, h in enumerate(handles):
        gen = _call(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h) or _call(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
        width = _call(nvml.nvmlDeviceGetMaxPcieLinkWidth, h) or _call(nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
        if gen and width:
            pcie.append(PCIE_LANE_GBPS.get(int(gen), 1.969) * int(width))
        procs = (_call(nvml.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []) + (
            _call(getattr(nvml, "nvmlDeviceGetGraphicsRunningProcesses", None) or (lambda _h: []), h, default=[]) or [])
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        root = sw.find(str(i))
        shares_switch = sum(sw.find(str(j)) == root for j in range(count)) > 1
        devices.append(Device(
            id=f"{name}/gpu{i}", node=name, index=i, memory_gb=round(int(mem.total) / 1e9, 1), free=not procs,
            pcie_switch=switch_names.setdefault(root, f"sw{len(switch_names)}") if shares_switch else None,
            nvlink_domain=nvl_name[i]))
    per_domain: dict[str, float] = {}
    for i, d in enumerate(nvl_name):
        if d is not None:
            per_domain[d] = min(per_domain.get(d, float("inf")), link_gbps[i])
    return Topology(nodes=[Node(
        name=name, devices=devices, network_gbps=network_gbps,
        nvlink_domain_gbps=min(per_domain.values()) if per_domain else 0.0,
        pcie_gbps=round(min(pcie), 3) if pcie else 25.0)])


def discover(nvml=None, node_name: str | None = None, network_gbps: float = DEFAULT_NETWORK_GBPS
             ) -> Topology | None:
    """This machine's GPUs through NVML (the `cuda` extra: nvidia-ml-py), or None — with the
    reason logged and kept in `last_discover_reason` — when there is no NVML or no GPU; callers
    then use a topology file. `nvml` injects a module with pynvml's API (tests)."""
    global last_discover_reason
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            return _none("nvidia-ml-py is not installed (pip install 'relayout[cuda]'); "
                         "pass a topology file instead")
    try:
        nvml.nvmlInit()
    except Exception as e:
        return _none(f"NVML did not initialise ({e}); no NVIDIA driver here? pass a topology file instead")
    try:
        if int(nvml.nvmlDeviceGetCount()) == 0:
            return _none("NVML sees no GPU on this machine; pass a topology file instead")
        topo = topology_from_nvml(nvml, node_name, network_gbps)
    except Exception as e:
        return _none(f"NVML discovery failed: {e!r}; pass a topology file instead")
    finally:
        _call(nvml.nvmlShutdown)
    last_discover_reason = ""
    return topo


def _none(reason: str) -> None:
    global last_discover_reason
    last_discover_reason = reason
    log.info("topology discovery: %s", reason)
    return None
