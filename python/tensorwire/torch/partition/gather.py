"""The gather loop: a stage waits for whichever incoming slot has a tensor in
one C++ wait (tw.wait_any, GIL released) that also watches the channels to
the stages it sends to: it fails as soon as a slot's sender or a watched
stage is gone (within the device's liveness bound), with nothing polled."""

from __future__ import annotations

import time
from typing import Any

import tensorwire as tw

from .graph import PartitionError


def gather_slots(
    dev: tw.Device,
    pending: dict[str, Any],
    watched: list[Any],
    peers: dict[int, str],
    seen: set[int],
    timeout: float,
    who: str,
    step: int,
) -> dict[str, Any]:
    """Takes a tensor from every slot of `pending`, in the order they arrive;
    fails fast when a peer stage is gone (a slot's sender, or the peer of a
    channel in `watched`). `peers`: device id -> description, to name the one
    that went; `seen`: those known to have connected (one that never did is
    the launcher's to judge: it watches every process)."""
    if len(seen) < len(peers):  # until every peer connected: once a gather, not in a loop
        alive = {int(p["device_id"]) for p in dev.peers()}
        seen.update(i for i in peers if i in alive)
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while pending:
        names = list(pending)
        try:
            k = tw.wait_any([pending[n] for n in names] + watched, timeout=max(0.0, deadline - time.monotonic()))
            out = pending[names[k]].recv(timeout=0)  # ready: at once (a full slot says why)
        except tw.Timeout:
            raise PartitionError(
                f"{who}: timed out after {timeout:.0f} s waiting for {', '.join(sorted(pending))} (step {step})"
            ) from None
        except tw.ConnectionError as e:
            alive = {int(p["device_id"]) for p in dev.peers()}
            dead = [d for i, d in peers.items() if i in seen and i not in alive]
            if dead:
                raise PartitionError(
                    f"{who}: {dead[0]} died or disconnected while waiting for "
                    f"{', '.join(sorted(pending))} (step {step})"
                ) from None
            raise PartitionError(
                f"{who}: a stage sending {', '.join(sorted(pending))} died or left (step {step}): {e}"
            ) from None
        got[names[k]] = out
        del pending[names[k]]
    return got
