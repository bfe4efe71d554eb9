"""The dispatch rule: which copy of an expert a token goes to. One definition, used by the engine
(engine.model.moe: each rank's table of candidate slots) and by the planner's model of it
(migrate.placement.dispatch_model, which scores placements with the rule's expected loads and traffic).

Locality first, the way node-aware all-to-all (DeepEP) is used: a token on device g that picked
expert e goes to
- g's own copies of e when g holds any (split evenly over them: it never leaves g);
- else the copies of e on g's node (each copy an equal share: split by copy count);
- else every copy of e (each an equal share: it crosses nodes).
A device is an expert-parallel rank: physical slots are dealt to devices in order, `len(row) /
num_devices` each (engine.model.layout.Layout.slots). Torch-free: the planner reads it without torch."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["candidate_slots"]


def candidate_slots(row: Sequence[int], num_devices: int, node_of: Sequence[int], device: int,
                    num_experts: int) -> list[list[int]]:
    """Per logical expert, the physical slots a token starting on `device` is spread over."""
    spd = len(row) // num_devices
    copies: list[list[int]] = [[] for _ in range(num_experts)]
    for s, e in enumerate(row):
        copies[e].append(s)
    out = []
    for e in range(num_experts):
        mine = [s for s in copies[e] if s // spd == device]
        near = [s for s in copies[e] if node_of[s // spd] == node_of[device]]
        out.append(mine or near or copies[e])
    return out
