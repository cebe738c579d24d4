"""PyTorch on tensorwire: the ``"tensorwire"`` torch.distributed backend
(``tensorwire.torch.backend``: ``import tensorwire.torch`` registers it), a
parameter-server runtime with zero-copy parameters and gradients
(``tensorwire.torch.ps``) and graph partitioning over slots
(``tensorwire.torch.partition``).

Importing this package imports torch and registers the backend. The paper's
benchmark models and their data, and the training sweeps, are the lab's
(``tensorwire.lab.paper``)."""

__all__ = ["backend", "ps", "partition"]

from .backend import register as _register

_register()
