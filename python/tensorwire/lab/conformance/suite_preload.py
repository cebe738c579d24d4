"""Imported by the forkserver of `--start forkserver` (suite._forkserver): builds the suite's class
once, so that every rank forked from that server starts with torch, the suite and the backend loaded.
Anywhere else (an import check of every module) importing it does nothing."""

import os

from .suite import _load

if os.environ.get("TENSORWIRE_CONFORMANCE_START") == "forkserver":
    _load()
