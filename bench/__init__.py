"""Benchmarks and the soak test (`relayout bench ...`, docs/benchmarks.md).

Installed as `relayout.bench`; the product never imports it: `relayout.agent.cli` finds the
`bench` sub-commands through the `relayout.commands` entry point group (`relayout.bench.cli`)."""
