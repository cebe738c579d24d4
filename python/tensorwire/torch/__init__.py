"""PyTorch on tensorwire: a parameter-server runtime with zero-copy parameters
and gradients (``tensorwire.torch.ps``), the paper's benchmark models
(``tensorwire.torch.models``) and their data (``tensorwire.torch.data``).

Importing this package does not import torch; its modules do."""

__all__ = ["ps", "models", "data"]
