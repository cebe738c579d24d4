"""Peer processes for the tests (spawned with multiprocessing's "spawn" context).

Every function here runs in a child process: it builds its own Device, reports
{"address", "pid", ...} through the pipe, then serves until told to stop (or
until the pipe closes, or a bounded idle time passes), so a failed test never
leaves a process behind.
"""

from __future__ import annotations

import json
import os
import traceback
import zlib

import numpy as np

IDLE_LIMIT_S = 600.0  # a server that hears nothing for this long exits (EOF ends it at once)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (both sides can build the same ones)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def crc(buf) -> int:
    return zlib.crc32(memoryview(buf).cast("B"))


def serve(conn, transport: str, regions: dict, device_kwargs: dict | None = None) -> None:
    """Publishes one zeroed block per entry of `regions` (name -> bytes) and
    answers calls:

    - "checksum" {"name", "offset", "nbytes"} -> crc32 of that range (ascii)
    - "fill" {"name", "offset", "nbytes", "seed"} -> writes pattern(nbytes, seed) there
    - "zero" {"name"} -> zeroes the whole block
    - "unpublish" {"name"}
    - "boom" -> raises ValueError (error propagation)
    """
    import tensorwire as tw

    try:
        dev = tw.Device(transport=transport, **(device_kwargs or {}))
        views = {}
        blocks = {}
        for name, nbytes in regions.items():
            blk = dev.alloc(int(nbytes))
            blocks[name] = blk
            views[name] = np.asarray(blk)
            dev.publish(name, blk)

        def checksum(payload: bytes) -> bytes:
            a = json.loads(payload)
            v = views[a["name"]][a["offset"]:a["offset"] + a["nbytes"]]
            return str(crc(v)).encode()

        def fill(payload: bytes) -> bytes:
            a = json.loads(payload)
            views[a["name"]][a["offset"]:a["offset"] + a["nbytes"]] = pattern(a["nbytes"], a["seed"])
            return b"ok"

        def zero(payload: bytes) -> bytes:
            views[json.loads(payload)["name"]][:] = 0
            return b"ok"

        def unpublish(payload: bytes) -> bytes:
            dev.unpublish(json.loads(payload)["name"])
            return b"ok"

        def boom(payload: bytes) -> bytes:
            raise ValueError("boom: " + payload.decode())

        for name, fn in [("checksum", checksum), ("fill", fill), ("zero", zero), ("unpublish", unpublish),
                         ("boom", boom)]:
            dev.on_call(name, fn)
        conn.send({"address": dev.address, "pid": os.getpid(), "device_id": dev.id})
    except BaseException:  # report, so the test fails with the child's traceback
        conn.send({"error": traceback.format_exc()})
        return
    try:
        while conn.poll(IDLE_LIMIT_S):
            msg = conn.recv()
            if msg == "stop":
                break
            if msg == "stats":
                conn.send(dev.stats())
            elif msg == "peers":
                conn.send(dev.peers())
    except (EOFError, OSError):
        pass  # the test process went away
    finally:
        dev.close()
    try:
        conn.send("stopped")
    except OSError:
        pass


def refused_connects(conn, transport: str, rounds: int) -> None:
    """Connects `rounds` times to ports nobody listens on, each right after a
    lookup on a live peer (so the control thread is awake and applies the
    refusal at once). Reports {"rounds", "max_s", "errors"}; a hang here is
    caught by the parent's bounded wait (UCX 1.22 spins forever sending on a
    client-server endpoint that failed before it was wired up)."""
    import socket
    import time

    import tensorwire as tw

    try:
        conn.send({"address": None, "pid": os.getpid()})
        dev = tw.Device(transport=transport, connect_timeout=2)
        live = tw.Device(transport=transport)
        blk = live.alloc(64)
        live.publish("x", blk)
        ch = dev.connect(live.address)
        worst, errors = 0.0, {}
        for _ in range(rounds):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ch.lookup("x")
            t0 = time.monotonic()
            try:
                dev.connect(f"127.0.0.1:{port}")
                errors["connected?!"] = errors.get("connected?!", 0) + 1
            except tw.Error as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            worst = max(worst, time.monotonic() - t0)
        ch.lookup("x")  # the device still works after all that
        dev.close()
        live.close()
        conn.send({"rounds": rounds, "max_s": worst, "errors": errors})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
