"""`tensorwire bench latency|bw|serve`: the older names of the point-to-point
family `bench write_lat|read_lat|write_bw|read_bw` (bench_fabric.py),
kept as aliases (`--op read` picks the read member), and the family's passive
side, which a client spawns on loopback."""

from __future__ import annotations

from .bench_fabric import register_aliases as register

__all__ = ["register"]
