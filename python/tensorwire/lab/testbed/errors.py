"""The testbed's errors."""

from __future__ import annotations

from ...errors import Error


class TestbedError(Error):
    """A testbed could not be created, found or removed."""

    __test__ = False  # not a pytest test class


class NotRoot(TestbedError, PermissionError):
    """The caller lacks the privileges (root) or the tools (ip netns, tc) a testbed needs."""
