"""Where a PS process computes and where the bytes it moves live.

One object, passed to Server and Worker, so that the CPU and the GPU run the
same code path with the memory kind as a parameter:

* ``Memory("cpu")``: torch computes on the CPU, over registered host memory
  (what the PS always did).
* ``Memory("cuda")`` (GDR on): torch computes on the GPU, and parameters,
  gradients and slots are registered GPU memory that the transport reads and
  writes directly (the paper's §3.5 GPUDirect RDMA).
* ``Memory("cuda", gdr=False)`` (GDR off, the paper's Table 2 baseline): torch
  computes on the GPU, but every tensor that moves is staged through registered
  host memory: a GPU-to-host copy before each send, the host transfer, a
  host-to-GPU copy after each receive.

``Memory("cpu", gdr=False)`` runs the GDR-off staging (separate compute tensors,
copies into and out of host blocks) on the CPU: it tests that path without a GPU.

Stream contract of the core: a GPU tensor handed to a send must be complete
(``sync()`` first); bytes a receive returned are visible to later kernels. The
flags and words the slots poll stay in host memory either way.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import VarSpec, tensor_of_view, torch_dtype

NO_GPU = "needs a CUDA GPU: torch.cuda.is_available() is False"


def cuda_problem(compute: str) -> str | None:
    """Why `compute` cannot run here (None: it can). Never initialises CUDA for "cpu"."""
    try:
        dev = torch.device(compute)
    except (RuntimeError, TypeError):
        return f"device must be cpu, cuda or cuda:N, not {compute!r}"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"device must be cpu, cuda or cuda:N, not {compute!r}"
    if not torch.cuda.is_available():
        return NO_GPU
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"there is no {compute} (this machine has {torch.cuda.device_count()} GPU(s))"
    return None


class Memory:
    """The torch device that computes (``device``) and the memory kind of the
    registered buffers that move (``kind``: "host", "cuda" or "cuda:N")."""

    def __init__(self, compute: str = "cpu", gdr: bool | None = None) -> None:
        self.device = torch.device(compute)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, not {compute!r}")
        self.cuda = self.device.type == "cuda"
        if gdr and not self.cuda:
            raise ValueError("gdr=True moves GPU memory directly: it needs device cuda")
        self.gdr = (gdr is not False) if self.cuda else None
        # staged: compute tensors and the bytes that move are different memory (GDR off)
        self.staged = gdr is False
        self.kind = str(self.device) if self.cuda and not self.staged else "host"
        # kernels read received GPU memory asynchronously: a buffer goes back to its
        # sender (release) or to the pool only after sync()
        self.defer = self.cuda and not self.staged

    @property
    def label(self) -> str:
        if not self.cuda:
            return "cpu" + (" (staged)" if self.staged else "")
        return f"{self.device} (GDR {'on' if self.gdr else 'off'})"

    def sync(self) -> None:
        """Waits for every kernel queued on the GPU (no-op on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _mem(self) -> dict:
        # host is the core's default: the keyword is passed only where it matters
        return {} if self.kind == "host" else {"memory": self.kind}

    def block(self, dev: Any, spec: VarSpec) -> Any:
        """A registered block for `spec`, in the memory that moves."""
        return dev.empty(spec.shape, spec.dtype, **self._mem())

    def static_slot(self, dev: Any, name: str, spec: VarSpec, depth: int) -> Any:
        return dev.static_slot(name, spec.shape, spec.dtype, depth=depth, **self._mem())

    def dynamic_slot(self, dev: Any, name: str) -> Any:
        return dev.dynamic_slot(name, **self._mem())

    def empty(self, spec: VarSpec) -> torch.Tensor:
        """A plain torch tensor on the compute device (not registered)."""
        return torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)

    @staticmethod
    def tensor(view: Any, spec: VarSpec) -> torch.Tensor:
        """A torch tensor over a received view (zero copy): a host static slot
        gives a numpy array, a GPU static slot a DLPack array on the GPU, every
        dynamic slot a Block."""
        if hasattr(view, "ctypes"):
            return tensor_of_view(view, spec)
        return torch.from_dlpack(view)

    @staticmethod
    def ptr(view: Any) -> int:
        if hasattr(view, "ctypes"):
            return view.ctypes.data
        p = getattr(view, "ptr", None)  # a Block; any other DLPack array through torch
        return p if p is not None else torch.from_dlpack(view).data_ptr()

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of received bytes on the compute device (the received buffer may go afterwards,
        on a GPU once sync() ran)."""
        return t.to(self.device, copy=True)

    def outgoing(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, ready to be sent: staged, a host copy of it (a blocking copy);
        on a GPU, complete (sync)."""
        if self.staged:
            return t.to("cpu", copy=True)
        self.sync()
        return t
