"""The two sides of the point-to-point benchmarks (the family `bench
write_lat|read_lat|write_bw|read_bw`, measured and reported by perftest/):
the passive server and the client that drives it. Also the fullmesh's window.

The server side is passive: it serves whatever the client asks for through
control-plane calls ("bench.*"), so the same server runs every test. Timed
loops run in C++ (tensorwire._core.bench_*); devices use inline progress so
the benchmark thread alone drives each worker (as perftest and ucx_perftest do).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from ... import Device, _core
from .common import BenchError, check_pattern, fill_pattern

ADDRESS_TAG = "TENSORWIRE_ADDRESS"
TIMEOUT_S = 120.0
FLOOR_RATE_BPS = 10e6  # the slowest rate a stream is waited for (a shaped testbed link is slower than tcp)
# A waiter spins this long, then sleeps on the worker's event fd. Measured
# on 2 vCPUs over loopback tcp: pure busy-polling (perftest's way) starves
# the kernel's own TCP work and cut write_bw at 1 MiB ~4x; latency kernels
# poll memory directly and never sleep.
BENCH_SPIN_US = int(os.environ.get("TENSORWIRE_BENCH_SPIN_US", "100"))
# Latency tests poll for much longer before sleeping (perftest busy-polls):
# on 2 vCPUs with a 100 us spin, read latency over tcp read 236 us typical
# (each side kept falling asleep and paying a wake-up) against 12.7 us with
# a 5 ms spin; write ping-pong waits spin on memory anyway.
LATENCY_SPIN_US = 20000


# Sizes below this use buffers from the pool's shared slabs, larger ones get
# their own (huge-page) blocks, as the pool does for any user's tensors: the
# two take different transport paths over shared memory (memcpy vs cma).
SMALL_LIMIT = 1 << 20


def size_class(size: int) -> str:
    return "small" if size < SMALL_LIMIT else "large"


class _Buffers:
    """send/recv/flag blocks of one side, published under bench.* names: one
    send/recv pair per size class, each sized for the largest size of its class."""

    def __init__(self, device: Device, max_size: int) -> None:
        self.send: dict[str, object] = {}
        self.recv: dict[str, object] = {}
        for cls, size in (("small", min(max_size, SMALL_LIMIT - 64)), ("large", max_size)):
            if cls == "large" and max_size < SMALL_LIMIT:
                continue
            self.send[cls] = device.alloc(max(size, 8), alignment=4096)
            self.recv[cls] = device.alloc(max(size, 8), alignment=4096)
            device.publish(f"bench.recv.{cls}", self.recv[cls])
        self.flag = device.alloc(64)
        self.flag_src = device.alloc(64)
        self.flag_view = np.frombuffer(memoryview(self.flag), dtype=np.uint64)
        self.flag_src_view = np.frombuffer(memoryview(self.flag_src), dtype=np.uint64)
        device.publish("bench.flag", self.flag)


def _signal(channel, buffers: _Buffers, remote_flag, seq: int) -> None:
    """Writes `seq` into the peer's flag word. Callers flushed their data
    first; no flush here: the peer stops progressing once it sees the flag,
    and a flush over tcp needs the peer's progress to complete."""
    buffers.flag_src_view[0] = seq
    channel.write(buffers.flag_src, remote_flag, nbytes=8).wait(TIMEOUT_S)


def serve(device: Device, announce: bool = True, idle_timeout: float = 600.0, ready=None) -> None:
    """Runs the passive side until the client says bench.stop (or goes idle).
    `ready()`, if given, is called once the handlers are in place."""
    state: dict[str, Any] = {"thread": None, "result": None, "buffers": None, "client": None}
    stop = threading.Event()
    remotes: dict[tuple[int, str], Any] = {}
    last_activity = [time.monotonic()]

    def channel(lane: int):
        return device.channel_to(state["client"], lane)

    def remote(lane: int, name: str):
        key = (lane, name)
        if key not in remotes:
            remotes[key] = channel(lane).lookup(name)
        return remotes[key]

    def setup(payload: bytes) -> bytes:
        req = json.loads(payload)
        state["buffers"] = _Buffers(device, int(req["max_size"]))
        state["client"] = int(req["client_id"])
        remotes.clear()
        last_activity[0] = time.monotonic()
        return b'{"ok": true}'

    def run(req: dict[str, Any]) -> dict[str, Any]:
        b: _Buffers = state["buffers"]
        kind, size, seq = req["kind"], int(req["size"]), int(req["seq"])
        if kind == "pingpong":
            cls = size_class(size)
            _core.bench_write_pingpong(
                channel(0),
                b.send[cls],
                b.recv[cls],
                remote(0, f"bench.recv.{cls}"),
                size,
                int(req["iters"]),
                int(req["warmup"]),
                False,
                TIMEOUT_S,
            )
            return {}
        if kind == "serve":
            # Progress (tcp targets must) until bench.result raises the flag.
            # The client may stream for long (perftest's 5000 iterations of
            # 256 MiB are 1.3 TB): allow for its volume at a floor rate; a
            # dead client ends the wait at once.
            bound = TIMEOUT_S + float(req.get("duration", 0)) + size * int(req.get("iters", 0)) / FLOOR_RATE_BPS
            ok = _core.bench_wait_flag(channel(0), b.flag.ptr, seq, bound)
            if ok:
                return {}
            return {"error": f"the client's end flag did not come within {bound:.0f} s (or the client failed)"}
        if kind in ("bidir_ops", "bidir_for"):
            lanes = int(req["lanes"])
            chans = [channel(i) for i in range(lanes)]
            cls = size_class(size)
            rem = [remote(i, f"bench.recv.{cls}") for i in range(lanes)]
            is_write = req["op"] == "write"
            if kind == "bidir_ops":
                seconds, posted, completions = _core.bench_stream_ops(
                    chans,
                    is_write,
                    b.send[cls],
                    rem,
                    size,
                    int(req["iters"]),
                    int(req["window"]),
                    int(req["warmup"]),
                    TIMEOUT_S,
                )
                out = {"seconds": seconds, "posted": list(posted), "completions": list(completions)}
            else:
                out = _core.bench_stream_for(
                    chans,
                    is_write,
                    b.send[cls],
                    rem,
                    size,
                    int(req["window"]),
                    float(req["duration"]),
                    float(req["margin"]),
                    float(req["bin"]),
                    float(req["duration"]) + TIMEOUT_S,
                )
            _signal(chans[0], b, remote(0, "bench.flag"), seq)
            if not _core.bench_wait_flag(chans[0], b.flag.ptr, seq, TIMEOUT_S):
                return {"error": "timed out waiting for the client's end flag"}
            return out
        return {"error": f"unknown benchmark kind {kind!r}"}

    def start(payload: bytes) -> bytes:
        req = json.loads(payload)
        last_activity[0] = time.monotonic()

        def body() -> None:
            try:
                state["result"] = run(req)
            except Exception as e:  # reported to the client through bench.result
                state["result"] = {"error": f"{type(e).__name__}: {e}"}

        state["result"] = None
        t = threading.Thread(target=body, daemon=True)
        state["thread"] = t
        t.start()
        return b'{"ok": true}'

    def result(payload: bytes) -> bytes:
        req = json.loads(payload or b"{}")
        if "seq" in req and state["buffers"] is not None:
            # The client is done with us: release the progressing thread.
            state["buffers"].flag_view[0] = int(req["seq"])
        t = state["thread"]
        if t is not None:
            t.join(TIMEOUT_S)
        last_activity[0] = time.monotonic()
        return json.dumps(state["result"] or {}).encode()

    def fill(payload: bytes) -> bytes:
        # {"which": "send"|"recv", "size", "seed" (None: zeros)}: prepares a buffer for validation
        req = json.loads(payload)
        b: _Buffers = state["buffers"]
        size = int(req["size"])
        fill_pattern(getattr(b, req["which"])[size_class(size)], size, req.get("seed"))
        return b'{"ok": true}'

    def check(payload: bytes) -> bytes:
        # {"which", "size", "seed"} -> {"mismatches", "first"}; the writer flushed before asking
        req = json.loads(payload)
        b: _Buffers = state["buffers"]
        size = int(req["size"])
        bad, first = check_pattern(getattr(b, req["which"])[size_class(size)], size, int(req["seed"]))
        return json.dumps({"mismatches": bad, "first": first}).encode()

    def stop_call(payload: bytes) -> bytes:
        stop.set()
        return b'{"ok": true}'

    for name, fn in (
        ("bench.setup", setup),
        ("bench.start", start),
        ("bench.result", result),
        ("bench.fill", fill),
        ("bench.check", check),
        ("bench.stop", stop_call),
    ):
        device.on_call(name, fn)
    if ready is not None:
        ready()
    if announce:
        print(f"{ADDRESS_TAG} {device.address}", flush=True)
    print(f"tensorwire bench server listening on {device.address}", file=sys.stderr, flush=True)
    while not stop.wait(0.2):
        busy = state["thread"] is not None and state["thread"].is_alive()
        if not busy and time.monotonic() - last_activity[0] > idle_timeout:
            print("bench server: idle timeout, exiting", file=sys.stderr)
            break


class Client:
    """The active side: connects, sets the server up, runs tests."""

    def __init__(self, device: Device, address: str, lanes: int, max_size: int) -> None:
        self.device = device
        self.lanes = lanes
        self.channels = [device.connect(address, lane=i) for i in range(lanes)]
        self.buffers = _Buffers(device, max_size)
        self.call("bench.setup", {"max_size": max_size, "client_id": device.id})
        self.remote_recv = {cls: [ch.lookup(f"bench.recv.{cls}") for ch in self.channels] for cls in self.buffers.recv}
        self.remote_flag = self.channels[0].lookup("bench.flag")
        self.seq = 0

    def call(self, name: str, req: dict[str, Any]) -> dict[str, Any]:
        out = json.loads(self.channels[0].call(name, json.dumps(req).encode(), timeout=TIMEOUT_S))
        if isinstance(out, dict) and out.get("error"):
            raise BenchError(f"bench server: {out['error']}")
        return out

    def latency(self, op: str, size: int, iters: int, warmup: int) -> list[float]:
        ch, b = self.channels[0], self.buffers
        if op == "write":
            self.call("bench.start", {"kind": "pingpong", "size": size, "iters": iters, "warmup": warmup, "seq": 0})
            cls = size_class(size)
            samples = _core.bench_write_pingpong(
                ch, b.send[cls], b.recv[cls], self.remote_recv[cls][0], size, iters, warmup, True, TIMEOUT_S
            )
            self.call("bench.result", {})
            return list(samples)
        self.seq += 1
        self.call("bench.start", {"kind": "serve", "size": size, "seq": self.seq})
        cls = size_class(size)
        samples = _core.bench_read_latency(ch, b.recv[cls], self.remote_recv[cls][0], size, iters, warmup)
        self.call("bench.result", {"seq": self.seq})
        return list(samples)

    def stream_ops(
        self, op: str, size: int, iters: int, window: int, bidirectional: bool, warmup: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Iteration mode with post and completion times (perftest's tposted/
        tcompleted); `iters` in total over the lanes. Returns (ours, the
        server's or None)."""
        b = self.buffers
        self.seq += 1
        cls = size_class(size)
        self.call(
            "bench.start",
            {
                "kind": "bidir_ops" if bidirectional else "serve",
                "size": size,
                "iters": iters,
                "window": window,
                "lanes": self.lanes,
                "op": op,
                "seq": self.seq,
                "warmup": warmup,
            },
        )
        seconds, posted, completions = _core.bench_stream_ops(
            self.channels, op == "write", b.send[cls], self.remote_recv[cls], size, iters, window, warmup, TIMEOUT_S
        )
        if bidirectional and not _core.bench_wait_flag(self.channels[0], b.flag.ptr, self.seq, TIMEOUT_S):
            raise BenchError("timed out waiting for the server's end flag")
        res = self.call("bench.result", {"seq": self.seq})
        ours = {"seconds": seconds, "posted": list(posted), "completions": list(completions)}
        return ours, (res if bidirectional else None)

    def stream_for(
        self, op: str, size: int, window: int, duration: float, margin: float, bidirectional: bool, bin_s: float = 0.1
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Duration mode (perftest -D): both sides stream for `duration` when
        bidirectional; counts only the completions between the margins."""
        b = self.buffers
        self.seq += 1
        cls = size_class(size)
        self.call(
            "bench.start",
            {
                "kind": "bidir_for" if bidirectional else "serve",
                "size": size,
                "window": window,
                "lanes": self.lanes,
                "op": op,
                "seq": self.seq,
                "duration": duration,
                "margin": margin,
                "bin": bin_s,
            },
        )
        ours = _core.bench_stream_for(
            self.channels,
            op == "write",
            b.send[cls],
            self.remote_recv[cls],
            size,
            window,
            duration,
            margin,
            bin_s,
            duration + TIMEOUT_S,
        )
        if bidirectional and not _core.bench_wait_flag(self.channels[0], b.flag.ptr, self.seq, TIMEOUT_S):
            raise BenchError("timed out waiting for the server's end flag")
        res = self.call("bench.result", {"seq": self.seq})
        return dict(ours), (res if bidirectional else None)

    # -- validation (OSU -c): patterned buffers, checked by the side that received --

    def prepare_validation(self, op: str, size: int, seed: int, bidirectional: bool) -> None:
        """Before a timed run: the data source holds pattern(seed), the sink zeros."""
        cls = size_class(size)
        if op == "write":
            fill_pattern(self.buffers.send[cls], size, seed)
            self.call("bench.fill", {"which": "recv", "size": size, "seed": None})
            if bidirectional:
                self.call("bench.fill", {"which": "send", "size": size, "seed": seed + 1})
                fill_pattern(self.buffers.recv[cls], size, None)
        else:  # read: we read the server's recv buffer into our send buffer
            self.call("bench.fill", {"which": "recv", "size": size, "seed": seed})
            fill_pattern(self.buffers.send[cls], size, None)
            if bidirectional:
                fill_pattern(self.buffers.recv[cls], size, seed + 1)
                self.call("bench.fill", {"which": "send", "size": size, "seed": None})

    def check_validation(self, op: str, size: int, seed: int, bidirectional: bool) -> list[str]:
        """After a timed run (everything flushed): the sinks hold the sources' pattern."""
        cls = size_class(size)
        errors = []
        if op == "write":
            r = self.call("bench.check", {"which": "recv", "size": size, "seed": seed})
            if r["mismatches"]:
                errors.append(f"client->server: {r['mismatches']} bytes differ from offset {r['first']}")
            if bidirectional:
                bad, first = check_pattern(self.buffers.recv[cls], size, seed + 1)
                if bad:
                    errors.append(f"server->client: {bad} bytes differ from offset {first}")
        else:
            bad, first = check_pattern(self.buffers.send[cls], size, seed)
            if bad:
                errors.append(f"read from server: {bad} bytes differ from offset {first}")
            if bidirectional:
                r = self.call("bench.check", {"which": "send", "size": size, "seed": seed + 1})
                if r["mismatches"]:
                    errors.append(f"server read from client: {r['mismatches']} bytes differ from offset {r['first']}")
        return errors

    def validate_rounds(self, op: str, size: int, rounds: int, base_seed: int) -> list[str]:
        """`rounds` untimed transfers, lanes taken in turn, each with its own
        pattern (seed base_seed + round), each checked by the receiving side."""
        cls = size_class(size)
        errors = []
        for r in range(rounds):
            seed = base_seed + r
            lane = r % self.lanes
            ch, remote = self.channels[lane], self.remote_recv[cls][lane]
            self.seq += 1
            if op == "write":
                fill_pattern(self.buffers.send[cls], size, seed)
                self.call("bench.fill", {"which": "recv", "size": size, "seed": None})
                self.call("bench.start", {"kind": "serve", "size": size, "seq": self.seq})
                ch.write(self.buffers.send[cls], remote, nbytes=size).wait(TIMEOUT_S)
                ch.flush().wait(TIMEOUT_S)
                res = self.call("bench.check", {"which": "recv", "size": size, "seed": seed})
                self.call("bench.result", {"seq": self.seq})
                bad, first = res["mismatches"], res["first"]
            else:
                self.call("bench.fill", {"which": "recv", "size": size, "seed": seed})
                fill_pattern(self.buffers.send[cls], size, None)
                self.call("bench.start", {"kind": "serve", "size": size, "seq": self.seq})
                ch.read(self.buffers.send[cls], remote, nbytes=size).wait(TIMEOUT_S)
                self.call("bench.result", {"seq": self.seq})
                bad, first = check_pattern(self.buffers.send[cls], size, seed)
            if bad:
                errors.append(f"round {r} lane {lane}: {bad} bytes differ from offset {first}")
        return errors

    def close(self) -> None:
        try:
            self.call("bench.stop", {})
        except Exception:
            pass


IN_FLIGHT_BYTES = 8 << 20


def window_for(size: int, window: int | None) -> int:
    """Operations in flight per lane: as asked, or by default enough to keep
    ~8 MiB in flight (at most 32). Measured on loopback tcp: 32 x 1 MiB in
    flight queues in UCX and runs ~25% slower than 8 x 1 MiB."""
    if window:
        return window
    return max(2, min(32, IN_FLIGHT_BYTES // max(1, size)))
