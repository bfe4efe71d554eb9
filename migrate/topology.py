"""Fleet topology: nodes, their devices, and the bandwidth between any two devices.

Bandwidths are in GB/s. Two devices on one node in the same NVLink domain talk at the
node's `nvlink_domain_gbps`; on one node without a shared NVLink domain they go over
PCIe (`pcie_gbps`); on different nodes over the network, limited by the slower NIC.
"""

from __future__ import annotations

import json
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


def discover() -> Topology | None:
    """Local device discovery via NVML is for CUDA machines and is tracked in another issue;
    on this machine there is nothing to discover, so callers must pass a topology file."""
    return None
