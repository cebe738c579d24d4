"""Imported by the forkserver of `--start forkserver` (suite._forkserver): builds the suite's class
once, so that every rank forked from that server starts with torch, the suite and the backend loaded."""

from .suite import _load

_load()
