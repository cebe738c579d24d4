"""PyTorch's distributed suite as test_distributed_spawn.py builds it, for the
backend named in the environment (imported by the runner and by every rank it
spawns: a rank unpickles the test class by this module's name).

The environment the conformance command sets before importing this:
  BACKEND, WORLD_SIZE, TEMP_DIR (with barrier/)  what test_distributed_spawn.py requires
  TENSORWIRE_CONFORMANCE_CLAIM    comma list of DistTestCases.backend_feature keys to claim for
                          BACKEND (a plugin backend's ``ddp``, ``subgroup``, ``plugin``)
  TENSORWIRE_CONFORMANCE_IMPORT   comma list of modules that register the backend
  TENSORWIRE_CONFORMANCE_TIMEOUT  seconds a test's ranks may run (MultiProcessTestCase's own limit)
  TENSORWIRE_CONFORMANCE_GATES    the backend name the suite's gates see (default BACKEND): "gloo" runs
                          the tests PyTorch gates to gloo's name on BACKEND too
  TENSORWIRE_CONFORMANCE_START    spawn (default: a fresh interpreter per rank, as PyTorch's runner) or
                          forkserver (ranks forked from one process that built this class once)

The claims go into common_distributed's DistTestCases before distributed_test is
imported: its skip decorators read them once, at import. They are made in this
process only (the runner and its ranks), never in the caller's, and only when the
class is first asked for: importing this module does nothing.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import multiprocessing.context
import os
import unittest
from typing import Any


@functools.cache
def _load() -> type:
    """Makes the claims, imports the suite, builds the class (once per process)."""
    backend = os.environ["BACKEND"]
    for module in filter(None, os.environ.get("TENSORWIRE_CONFORMANCE_IMPORT", "").split(",")):
        importlib.import_module(module)

    from torch.testing._internal import common_distributed

    for feature in filter(None, os.environ.get("TENSORWIRE_CONFORMANCE_CLAIM", "").split(",")):
        common_distributed.DistTestCases.backend_feature.setdefault(feature, set()).add(backend)
    # One limit for every test (PyTorch's default is 300 s, with longer overrides for two DDP tests).
    timeout = int(os.environ.get("TENSORWIRE_CONFORMANCE_TIMEOUT", "0") or 0)
    if timeout > 0:
        common_distributed.TIMEOUT_DEFAULT = timeout
        common_distributed.TIMEOUT_OVERRIDE.clear()

    import torch

    # The gates (skip decorators) read distributed_test.BACKEND at import; the tests and their ranks
    # read it when they run (init_process_group(backend=BACKEND)): that one is always the real backend.
    os.environ["BACKEND"] = os.environ.get("TENSORWIRE_CONFORMANCE_GATES") or backend
    try:
        from torch.testing._internal.distributed import distributed_test
    finally:
        os.environ["BACKEND"] = backend
    distributed_test.BACKEND = backend
    torch.backends.cuda.matmul.allow_tf32 = False

    class TestDistBackendWithSpawn(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
        """test_distributed_spawn.py's class: every test spawns WORLD_SIZE ranks."""

        def setUp(self) -> None:
            super().setUp()
            if os.environ.get("TENSORWIRE_CONFORMANCE_START") == "forkserver":
                self._start_processes(_forkserver())
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    # ranks unpickle it by this module's name (module __getattr__ below)
    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    return TestDistBackendWithSpawn


class _ForkedRank(multiprocessing.context.ForkServerProcess):
    """A rank forked by the forkserver, with the environment of the runner at the time it was made (the
    server's own is the one it started with: each test's setUp sets a new TEMP_DIR, which the ranks use
    for their barriers' lock files)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environment = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self.environment)
        super().run()


@functools.cache
def _forkserver() -> Any:
    """Ranks forked by a server that has imported torch, the suite and the backend and built the class
    (suite_preload): a rank then costs a fork, not seconds of imports. They are forked from that
    single-threaded server, never from the runner."""
    multiprocessing.set_forkserver_preload([__name__ + "_preload"])
    return _ForkedRank


def __getattr__(name: str) -> Any:
    # Lazy: importing this module (the package's import checks) needs no BACKEND; the runner and
    # every rank (unpickling the class) build it on first use.
    if name == "TestDistBackendWithSpawn":
        return _load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def test_names() -> list[str]:
    """Every test of the suite, in unittest's order."""
    return list(unittest.TestLoader().getTestCaseNames(_load()))


def static_skip(name: str) -> str | None:
    """The reason a test is skipped without spawning a rank (a decorator's gate), or None."""
    fn = getattr(_load(), name)
    return getattr(fn, "__unittest_skip_why__", "skipped") if getattr(fn, "__unittest_skip__", False) else None
