"""tensorwire's exceptions: one class per kind of failure of the C++ core.

Each also derives from the built-in a caller would naturally catch
(``TimeoutError``, ``ConnectionError``, ``ValueError``, ``MemoryError``, ``KeyError``).
"""

import builtins


class Error(Exception):
    """Base of every tensorwire error."""


class InvalidArgument(Error, ValueError):
    """Bad input (range, shape, option); nothing was posted."""


class Timeout(Error, builtins.TimeoutError):
    """A wait ran past its deadline; the operation may still complete."""


class ConnectionError(Error, builtins.ConnectionError):  # noqa: A001 - deliberate shadowing
    """A peer cannot be reached, or the device/channel is closed."""


class PeerFailed(ConnectionError):
    """The peer died or disconnected; work pending on it failed."""


class PoolExhausted(Error, MemoryError):
    """The registered memory pool has no room within its limit."""


class ProtocolMismatch(ConnectionError):
    """The peer speaks another protocol version."""


class NotFound(Error, KeyError):
    """No region or call handler of that name on the peer."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


__all__ = [
    "Error",
    "InvalidArgument",
    "Timeout",
    "ConnectionError",
    "PeerFailed",
    "PoolExhausted",
    "ProtocolMismatch",
    "NotFound",
]
