"""The ``"tensorwire"`` torch.distributed backend: unchanged PyTorch programs (DDP, FSDP,
pipelining, checkpointing, send/recv) move their CPU tensors over tensorwire after
``import tensorwire.torch`` and one changed word::

    import torch.distributed as dist
    import tensorwire.torch               # registers "tensorwire"
    dist.init_process_group("tensorwire")  # was "gloo"; or "cpu:tensorwire,cuda:nccl"

The backend is C++ (``cpp/torch/``, the extension module ``tensorwire._c10d``): a
``c10d::Backend`` on tensorwire's message engine and collectives layer, registered for CPU
tensors with torch's extended API, so a mixed spec keeps another backend for CUDA tensors and
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps it like gloo. Each group meets its peers through the
c10d store torch hands it (env://, tcp://, file://, store=, torchrun, ``tensorwire run``).
docs/torch.md has the ops, dtypes, limits and how failures surface.

``_c10d`` is built against one torch version (c10d has no stable ABI); importing it under
another torch raises ImportError naming both and how to rebuild.
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from .. import errors as tw_errors

BACKEND = "tensorwire"


class TensorwireError(dist.DistBackendError, tw_errors.Error):
    """An op of the tensorwire backend failed: a peer failed or was silent (named), or the ranks disagree.
    (Errors raised inside the C++ backend reach Python as torch's DistBackendError, its base.)"""


def progress_mode(transport: str, size: int, env: Any = None) -> str:
    """The Devices' progress mode, as the C++ backend chooses it (cpp/torch/process_group.cc):
    inline where every peer is reached through shared memory, blocking elsewhere.
    TENSORWIRE_PROGRESS, read by the core, overrides it."""
    env = os.environ if env is None else env
    if transport == "shm":
        return "inline"
    if transport != "auto":
        return "blocking"
    tls = env.get("UCX_TLS", "")
    if tls and not any(t in tls for t in ("all", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem")):
        return "blocking"
    one_host = env.get("LOCAL_WORLD_SIZE") == str(size) or size == 1
    return "inline" if one_host else "blocking"


def load() -> Any:
    """The C++ backend's module, checked against the torch imported here."""
    try:
        from .. import _c10d
    except ImportError as e:
        raise ImportError(
            f"tensorwire was built without its torch.distributed backend (tensorwire._c10d: {e}); "
            "rebuild it where torch is installed: pip install --no-build-isolation tensorwire "
            "(TENSORWIRE_BUILD_TORCH=ON makes a build without torch fail)"
        ) from None
    if _c10d.torch_version != torch.__version__:
        raise ImportError(
            f"tensorwire's torch.distributed backend was built for torch {_c10d.torch_version}, "
            f"but torch {torch.__version__} is installed; rebuild tensorwire against it: "
            "pip install --no-build-isolation --force-reinstall --no-deps tensorwire"
        )
    return _c10d


def _seconds(timeout: Any) -> float:
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else 1800.0


# At interpreter exit every live group finishes what it queued (bounded), so that its threads drop
# no tensor while Python finalizes: a program that ended without destroy_process_group() had its
# last Work dropped by the group's worker thread, whose decref then waited for the GIL of a
# finalizing interpreter, which ends such a thread: std::terminate, SIGABRT (1 exit in 3 or 4 here,
# dense ops alike).
QUIESCE_AT_EXIT_S = 10.0


def _quiesce_at_exit() -> None:
    try:
        from .. import _c10d

        _c10d._quiesce_all(QUIESCE_AT_EXIT_S)
    except Exception:  # noqa: BLE001 - exit goes on whatever the groups say
        pass


def create(dist_opts: Any, pg_options: Any = None) -> Any:
    """torch.distributed's creator (extended API): one C++ backend for the group's CPU tensors."""
    c10d = load()
    atexit.unregister(_quiesce_at_exit)  # once, and last: it runs before the exit hooks registered earlier
    atexit.register(_quiesce_at_exit)
    return c10d.ProcessGroupTensorwire(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        datetime.timedelta(seconds=_seconds(dist_opts.timeout)),
        str(dist_opts.group_id or ""),
    )


def register() -> None:
    """Registers the backend "tensorwire" for CPU tensors (idempotent)."""
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
