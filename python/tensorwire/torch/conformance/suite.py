"""PyTorch's distributed suite as test_distributed_spawn.py builds it, for the
backend named in the environment (imported by the runner and by every rank it
spawns: a rank unpickles the test class by this module's name).

The environment the conformance command sets before importing this:
  BACKEND, WORLD_SIZE, TEMP_DIR (with barrier/)  what test_distributed_spawn.py requires
  TW_CONFORMANCE_CLAIM    comma list of DistTestCases.backend_feature keys to claim for
                          BACKEND (a plugin backend's ``ddp``, ``subgroup``, ``plugin``)
  TW_CONFORMANCE_IMPORT   comma list of modules that register the backend
  TW_CONFORMANCE_TIMEOUT  seconds a test's ranks may run (MultiProcessTestCase's own limit)
  TW_CONFORMANCE_GATES    the backend name the suite's gates see (default BACKEND): "gloo" runs
                          the tests PyTorch gates to gloo's name on BACKEND too

The claims go into common_distributed's DistTestCases before distributed_test is
imported: its skip decorators read them once, at import. They are made in this
process only (the runner and its ranks), never in the caller's.
"""

from __future__ import annotations

import importlib
import os
import unittest

BUILTIN = ("gloo", "nccl", "ucc", "mpi")
BACKEND = os.environ["BACKEND"]

for _module in filter(None, os.environ.get("TW_CONFORMANCE_IMPORT", "").split(",")):
    importlib.import_module(_module)

from torch.testing._internal import common_distributed  # noqa: E402

for _feature in filter(None, os.environ.get("TW_CONFORMANCE_CLAIM", "").split(",")):
    common_distributed.DistTestCases.backend_feature.setdefault(_feature, set()).add(BACKEND)

# One limit for every test (PyTorch's default is 300 s, with longer overrides for two DDP tests).
_timeout = int(os.environ.get("TW_CONFORMANCE_TIMEOUT", "0") or 0)
if _timeout > 0:
    common_distributed.TIMEOUT_DEFAULT = _timeout
    common_distributed.TIMEOUT_OVERRIDE.clear()

import torch  # noqa: E402

# The gates (skip decorators) read distributed_test.BACKEND at import; the tests and their ranks
# read it when they run (init_process_group(backend=BACKEND)): that one is always the real backend.
GATES = os.environ.get("TW_CONFORMANCE_GATES") or BACKEND
os.environ["BACKEND"] = GATES
try:
    from torch.testing._internal.distributed import distributed_test  # noqa: E402
finally:
    os.environ["BACKEND"] = BACKEND
distributed_test.BACKEND = BACKEND
DistributedTest, TestDistBackend = distributed_test.DistributedTest, distributed_test.TestDistBackend

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """test_distributed_spawn.py's class: every test spawns WORLD_SIZE ranks."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def test_names() -> list[str]:
    """Every test of the suite, in unittest's order."""
    return list(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))


def static_skip(name: str) -> str | None:
    """The reason a test is skipped without spawning a rank (a decorator's gate), or None."""
    fn = getattr(TestDistBackendWithSpawn, name)
    return getattr(fn, "__unittest_skip_why__", "skipped") if getattr(fn, "__unittest_skip__", False) else None
