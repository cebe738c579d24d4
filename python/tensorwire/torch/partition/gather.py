"""The gather loop: a stage polls its incoming slots in turn, re-polls the
ones not ready (polling-async), and fails fast when a peer stage is gone."""

from __future__ import annotations

import time
from typing import Any

import tensorwire as tw

from .graph import PartitionError

POLL_S = 0.25                    # how often a waiting stage checks its peers' liveness
MIN_SLEEP_S, MAX_SLEEP_S = 20e-6, 1e-3


def _gather(dev: tw.Device, pending: dict[str, Any], peers: dict[int, str], seen: set[int], timeout: float,
            who: str, step: int) -> dict[str, Any]:
    """Polls every incoming slot, re-polling those not ready (polling-async)
    with a back-off sleep; fails fast when a peer stage is gone."""
    got: dict[str, Any] = {}
    start = time.monotonic()
    next_check, delay = start + POLL_S, MIN_SLEEP_S
    while pending:
        progressed = False
        for name in list(pending):
            try:
                out = pending[name].poll()
            except tw.ConnectionError as e:
                raise PartitionError(f"{who}: the stage sending {name!r} died or left (step {step}): {e}") from None
            if out is not None:
                got[name] = out
                del pending[name]
                progressed = True
        if not pending:
            break
        if progressed:
            delay = MIN_SLEEP_S
            continue
        time.sleep(delay)
        delay = min(2 * delay, MAX_SLEEP_S)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + POLL_S
            alive = {int(p["device_id"]) for p in dev.peers()}
            # a peer counts once it connected (producers attach when they are ready); one that was
            # never seen is the launcher's to judge (it watches every process)
            dead = [d for i, d in peers.items() if i in seen and i not in alive]
            seen.update(i for i in peers if i in alive)
            if dead:
                raise PartitionError(f"{who}: {dead[0]} died or disconnected while waiting for "
                                     f"{', '.join(sorted(pending))} (step {step})")
            if now - start > timeout:
                raise PartitionError(f"{who}: timed out after {timeout:.0f} s waiting for "
                                     f"{', '.join(sorted(pending))} (step {step})")
    return got
