"""The process launch: one spawned process per stage, handed each other's
addresses; their statistics collected, and the first failure of any stage
fails the run."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from .graph import PartitionError
from .stage import StageStats, _stage_main


def _launch(stages: int, cfg: dict, die: tuple[int, int] | None) -> list[StageStats]:
    """Spawns the stage processes, hands them each other's addresses, and
    returns their statistics; the first failure of any stage fails the run."""
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    timeout = cfg["timeout"]
    for s in range(stages):
        a, b = ctx.Pipe()
        c = dict(cfg, die_at=die[1] if die and die[0] == s else None)
        pr = ctx.Process(target=_stage_main, args=(b, s, c), name=f"tw-stage-{s}", daemon=True)
        pr.start()
        b.close()  # the child's end: its exit then reads as EOF here
        procs.append(pr)
        conns.append(a)
    try:
        addresses = [_expect(conns[s], procs[s], s, "address", timeout)[1:] for s in range(stages)]
        for c in conns:
            c.send(("addresses", addresses))
        results: dict[int, StageStats] = {}
        deadline = time.monotonic() + timeout * cfg["steps"] + 60
        while len(results) < stages:
            for s in range(stages):
                if s in results:
                    continue
                if conns[s].poll(0.05):
                    try:
                        msg = conns[s].recv()
                    except (EOFError, OSError):
                        procs[s].join(1)
                        raise PartitionError(f"stage {s} exited (code {procs[s].exitcode}) before its result") \
                            from None
                    if msg[0] == "error":
                        raise PartitionError(_root_cause(procs, conns, s, msg))
                    results[s] = msg[1]
                elif not procs[s].is_alive():
                    raise PartitionError(f"stage {s} exited with code {procs[s].exitcode} at no result")
            if time.monotonic() > deadline:
                raise PartitionError("the pipeline did not finish in time")
        for c in conns:
            c.send(("exit",))
        for pr in procs:
            pr.join(10)
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
                pr.join(5)
    return [results[s] for s in range(stages)]


def _root_cause(procs: list, conns: list, s: int, msg: tuple) -> str:
    """The first failure: of the errors the stages report within a second of
    this one, the earliest (a stage that fails makes its peers fail next), led
    by the death of a stage if one died (that is then usually why)."""
    errors = [(msg[2], msg[1])]
    deadline = time.monotonic() + 1.0
    dead: list = []
    while time.monotonic() < deadline:
        for t, c in enumerate(conns):
            try:
                if t != s and c.poll(0):
                    m = c.recv()
                    if m[0] == "error":
                        errors.append((m[2], m[1]))
            except (EOFError, OSError):
                pass
        dead = [(t, pr.exitcode) for t, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
        if dead:
            break
        time.sleep(0.05)
    first = min(errors)[1]
    return f"stage {dead[0][0]} exited with code {dead[0][1]}; then {first}" if dead else first


def _expect(conn: Any, proc: Any, s: int, kind: str, timeout: float) -> tuple:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.05):
        if not proc.is_alive():
            raise PartitionError(f"stage {s} exited with code {proc.exitcode} during setup")
        if time.monotonic() > deadline:
            raise PartitionError(f"stage {s} did not start within {timeout:.0f} s")
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        proc.join(1)
        raise PartitionError(f"stage {s} exited (code {proc.exitcode}) during setup") from None
    if msg[0] == "error":
        raise PartitionError(msg[1])
    if msg[0] != kind:
        raise PartitionError(f"stage {s}: unexpected {msg[0]!r} during setup")
    return msg
