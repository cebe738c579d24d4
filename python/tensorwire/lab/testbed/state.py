"""Testbed names and state files: the default name, a name's state file and the namespaces
it owns, the testbeds with a state file."""

from __future__ import annotations

import os
import re
from typing import Sequence

from .errors import TestbedError

DEFAULT_NAME = "tw"
STATE_DIR = "/run/tensorwire"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def default_name() -> str:
    """The testbed name commands use when none is given: $TENSORWIRE_TESTBED or 'tw'."""
    return os.environ.get("TENSORWIRE_TESTBED") or DEFAULT_NAME


def state_path(name: str) -> str:
    return os.path.join(STATE_DIR, f"testbed-{name}.json")


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise TestbedError(
            f"bad testbed name {name!r}: 1-32 characters of a-z, 0-9, '-' and '_', starting with a letter or digit"
        )
    return name


def owned_namespaces(name: str, present: Sequence[str]) -> list[str]:
    """The namespaces of testbed `name` among `present` (exact scheme, so 'a' never takes 'a-b''s)."""
    pat = re.compile(rf"^tw-{re.escape(name)}-(sw|h[0-9]+)$")
    return [ns for ns in present if pat.match(ns)]


def list_testbeds() -> list[str]:
    """Names of the testbeds with a state file here."""
    try:
        names = os.listdir(STATE_DIR)
    except FileNotFoundError:
        return []
    return sorted(n[len("testbed-") : -len(".json")] for n in names if n.startswith("testbed-") and n.endswith(".json"))
