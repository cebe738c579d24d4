"""PyTorch on tensorwire: the ``"tensorwire"`` torch.distributed backend
(``tensorwire.torch.backend``: ``import tensorwire.torch`` registers it), a
parameter-server runtime with zero-copy parameters and gradients
(``tensorwire.torch.ps``), the paper's benchmark models
(``tensorwire.torch.models``) and their data (``tensorwire.torch.data``).

Importing this package imports torch and registers the backend, except while
the command line loads its command modules (``tensorwire.cli``: importing a
command module stays cheap; its commands import torch when they run)."""

import sys as _sys

__all__ = ["backend", "ps", "models", "data"]

if not getattr(_sys.modules.get("tensorwire.cli"), "LOADING_COMMANDS", False):
    from .backend import register as _register
    _register()
