"""Placement and re-layout: topology, the planner, the policy and its controller."""
