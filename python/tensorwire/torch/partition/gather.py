"""The gather loop: a stage waits for whichever incoming slot has a tensor
(tw.wait_any: the C++ wait, GIL released, failing at once when a slot's
sender dies) and, every POLL_S, checks that its peer stages are alive."""

from __future__ import annotations

import time
from typing import Any

import tensorwire as tw

from .graph import PartitionError

POLL_S = 0.25  # how often a waiting stage checks its peers' liveness


def _gather(dev: tw.Device, pending: dict[str, Any], peers: dict[int, str], seen: set[int], timeout: float,
            who: str, step: int) -> dict[str, Any]:
    """Takes a tensor from every slot of `pending`, in the order they arrive;
    fails fast when a peer stage is gone."""
    got: dict[str, Any] = {}
    start = time.monotonic()
    while pending:
        names = list(pending)
        try:
            k = tw.wait_any([pending[n] for n in names], timeout=POLL_S)
            out = pending[names[k]].recv(timeout=0)  # ready: at once (a full slot says why)
        except tw.Timeout:
            out = None
        except tw.ConnectionError as e:
            raise PartitionError(f"{who}: a stage sending {', '.join(sorted(pending))} died or left "
                                 f"(step {step}): {e}") from None
        if out is not None:
            got[names[k]] = out
            del pending[names[k]]
            continue
        alive = {int(p["device_id"]) for p in dev.peers()}
        # a peer counts once it connected (producers attach when they are ready); one that was
        # never seen is the launcher's to judge (it watches every process)
        dead = [d for i, d in peers.items() if i in seen and i not in alive]
        seen.update(i for i in peers if i in alive)
        if dead:
            raise PartitionError(f"{who}: {dead[0]} died or disconnected while waiting for "
                                 f"{', '.join(sorted(pending))} (step {step})")
        if time.monotonic() - start > timeout:
            raise PartitionError(f"{who}: timed out after {timeout:.0f} s waiting for "
                                 f"{', '.join(sorted(pending))} (step {step})")
    return got
