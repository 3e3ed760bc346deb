"""Helpers that tests, `prelude bench` and the lab instruments in benchmarks/ share: random-weight
model directories built locally from architecture configs (no model hub)."""
