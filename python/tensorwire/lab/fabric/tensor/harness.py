"""The harness of `tensorwire bench tensor`: the receiver process and the
sender's handle on it, the receiver's checks, the serial and stream passes of
one series, the warm-up rule and the memcpy anchor."""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Any, Callable

import numpy as np

from ....ranks.roles import RoleError, Roles
from ..common import BenchError, Progress, Report, bind_cpu, check_number, check_transports, human_size, iterations_for
from .base import DTYPE, ITEM, START_TIMEOUT_S, STREAM_FROM, Series, fill_pattern
from .registry import series_class

# Receiver processes start with one BLAS/OpenMP thread: OpenBLAS's pool
# thread busy-waits after numpy is imported (~50 ms of CPU measured, and a
# receiver thread was seen at ~90% of a core), which on 2 vCPUs competes with
# the two benchmark processes. Nothing here uses BLAS.
CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# One-way times subtract the sender's t0 from the receiver's arrival time:
# only meaningful when perf_counter is the host-wide monotonic clock (Linux).
SHARED_CLOCK = time.get_clock_info("perf_counter").implementation.startswith("clock_gettime(CLOCK_MONOTONIC")


def bench_spin_us() -> int:
    from ..p2p import BENCH_SPIN_US

    return BENCH_SPIN_US


class _Checker:
    """Receiver-side consumption and checks of one size."""

    def __init__(self, size: int, count: int, verify: bool, reduce: bool = True) -> None:
        self.n = size // ITEM
        self.reduce = reduce  # False: the transfer-only pass reads just the first element
        self.count = count
        self.verify = verify
        self.k = 0
        self.errors: list[str] = []
        self.verified = 0
        self.expected = None
        if verify:
            self.expected = np.empty(self.n, DTYPE)
            fill_pattern(self.expected)

    def error(self, msg: str) -> None:
        if len(self.errors) < 5:
            self.errors.append(msg)

    def consume(self, arr: np.ndarray) -> None:
        k = self.k
        self.k += 1
        m = arr.max() if self.reduce else arr.reshape(-1)[0]  # the consumption (or only the tag)
        if arr.dtype != DTYPE or arr.size != self.n:
            self.error(f"transfer {k}: got {arr.dtype}[{arr.size}], expected float32[{self.n}]")
            return
        ok = float(m) == 1.0 + k
        if not ok:
            self.error(f"transfer {k}: max {float(m)} != {1.0 + k} (stale or corrupted tensor)")
        if self.verify:
            expected = self.expected
            assert expected is not None  # made for verify
            flat = arr.reshape(-1)
            if not np.array_equal(flat[1:], expected[1:]):
                bad = np.flatnonzero(flat[1:] != expected[1:]) + 1
                self.error(f"transfer {k}: {bad.size} element(s) differ, the first at index {bad[0]}")
            elif ok and float(flat[0]) == 1.0 + k:
                self.verified += 1

    def result(self) -> dict[str, Any]:
        return {"received": self.k, "verified": self.verified, "errors": self.errors}


# --- the receiver process ---------------------------------------------------------------------


def _receiver_main(conn, name: str, cfg: dict[str, Any]) -> None:
    """Runs one series' receiver side, driven by commands on `conn`."""
    series: Series | None = None
    try:
        if cfg.get("cpus"):
            bind_cpu(cfg["cpus"][1])  # before the series makes its device: its threads inherit the CPU
        series = series_class(name, cfg.get("memory", "host"))(cfg)
        while True:
            if not conn.poll(float(cfg.get("idle_timeout", 600))):
                return  # the benchmark went away
            msg = conn.recv()
            cmd = msg[0]
            try:
                if cmd == "open":
                    out: Any = series.r_open()
                elif cmd == "connect":
                    series.r_connect(msg[1])
                    out = None
                elif cmd == "prepare":
                    out = series.r_prepare(int(msg[1]))
                elif cmd == "serve":
                    _, size, count, verify, stream, reduce = msg
                    size, count, verify, reduce = int(size), int(count), bool(verify), bool(reduce)
                    checker = series.make_checker(size, count, verify, reduce, not stream) or _Checker(
                        size, count, verify, reduce
                    )
                    series.serve(int(count), checker.consume, bool(stream))
                    out = checker.result()
                elif cmd == "drive":  # progress the worker until the next command (RMA anchors)
                    series.drive(lambda: conn.poll(0))
                    out = None
                elif cmd == "stop":
                    out = None
                elif cmd == "close":
                    conn.send(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", out))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
                return
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    finally:
        if series is not None:
            try:
                series.r_close()
            except Exception:
                pass


class _Receiver:
    """The sender's handle on the spawned receiver process."""

    def __init__(self, name: str, cfg: dict[str, Any]) -> None:
        self.roles = Roles()
        # CHILD_ENV: the user's settings win
        self.role = self.roles.spawn(f"{name} receiver", _receiver_main, name, cfg, env_defaults=CHILD_ENV)
        self.name = name

    def post(self, *msg: Any) -> None:
        self.role.send(msg)

    def result(self, timeout: float) -> Any:
        try:
            return self.role.recv(timeout)[1]
        except RoleError:
            if self.role.error is not None:
                raise BenchError(f"{self.name} receiver failed: {self.role.error}") from None
            raise BenchError(f"{self.name} receiver exited (code {self.role.exitcode})") from None
        except TimeoutError:
            raise TimeoutError(f"{self.name} receiver did not answer in {timeout:.0f} s") from None

    def error_hint(self, wait: float = 2.0) -> str:
        """The receiver's own error, if it reported one (after a failed transfer)."""
        try:
            self.role.recv(wait)
        except RoleError:
            if self.role.error is not None:
                return f"; the receiver reported: {first_line(self.role.error)}"
            return f"; the receiver exited (code {self.role.exitcode})"
        except TimeoutError:
            pass
        return ""

    def call(self, timeout: float, *msg: Any) -> Any:
        self.post(*msg)
        return self.result(timeout)

    def close(self) -> None:
        if self.role.alive:
            try:
                self.post("close")
            except OSError:
                pass
        self.roles.stop(wait=10)


# --- the benchmark ----------------------------------------------------------------------------


def warmup_for(size: int, iters: int, budget: int, warmup: int | None) -> int:
    """Untimed iterations before a size: as asked, or a tenth of the timed
    ones, raised for small sizes to an eighth of the byte budget (at most 200).
    Seen on 2 vCPUs over shm (ucx-tag, 4 KiB, a machine shared with other
    work): the first few hundred transfers of a fresh pair of processes ran
    ~2.5x slower than later ones (11 vs 4.3 us)."""
    if warmup is not None:
        return max(0, warmup)
    return max(2, min(200, max(iters // 10, budget // (8 * max(1, size)))))


def run_series(
    name: str,
    cfg: dict[str, Any],
    args,
    progress: Progress,
    rows: list[dict[str, Any]],
    report: Report,
    measured: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Every size of one series: each row appended to `rows`, then handed to `measured`."""
    series = series_class(name, cfg.get("memory", "host"))(cfg)
    rx = _Receiver(name, cfg)
    transport = series.fixed_transport or args.transport
    try:
        info = rx.call(START_TIMEOUT_S + cfg["timeout"], "open")
        info2 = series.s_open(info)
        rx.post("connect", info2)
        series.s_connect()
        ch = getattr(series, "ch", None)
        if ch is not None and series.fixed_transport is None:
            check_transports(report, args.transport, [ch])  # a tensorwire series: which UCX lanes
        rx.result(START_TIMEOUT_S + cfg["timeout"])
        for size in args.sizes:
            rinfo = rx.call(cfg["timeout"], "prepare", size)
            view = series.s_prepare(size, rinfo)
            series.fill(view)
            iters = iterations_for(size, args.iters, args.budget)
            warmup = warmup_for(size, iters, args.budget, args.warmup)
            count = warmup + iters
            rx.post("serve", size, count, args.verify, False, True)
            samples, starts, own = [], [], []
            clock = time.perf_counter
            fresh = series.snapshot(view) if getattr(args, "refresh", False) else None
            try:
                for k in range(count):
                    if fresh is not None:
                        series.restore(view, fresh)  # every line dirty in the sender's cache, as if just computed
                    series.stamp(view, k)
                    t0 = clock()
                    one = series.transfer()
                    t1 = clock()
                    if k >= warmup:
                        samples.append(t1 - t0)
                        starts.append(t0)
                        if one is not None:
                            own.append(one)
            except Exception as e:
                raise BenchError(
                    f"transfer {k} of {human_size(size)} failed: {type(e).__name__}: {first_line(e)}{rx.error_hint()}"
                ) from e
            res = rx.result(cfg["timeout"] * 2 + 30)
            median = statistics.median(samples)
            row = {
                "series": name,
                "transport": transport,
                "size": size,
                "iters": iters,
                "median_us": median * 1e6,
                "MBps": size / median / 1e6,
                "warmup": warmup,
                "min_us": min(samples) * 1e6,
                "verified": res["verified"] if args.verify else None,
            }
            check_number(report, f"{name} median", row["median_us"], size)
            _oneway(row, res, starts, own, warmup, report)
            if res["received"] != count:
                report.fail(f"{name} at {human_size(size)}: receiver consumed {res['received']} of {count}")
            for err in res["errors"]:
                report.fail(f"{name} at {human_size(size)}: {err}")
            if args.verify and not res["errors"] and res["verified"] != count:
                report.fail(f"{name} at {human_size(size)}: verified {res['verified']} of {count}")
            if getattr(args, "stream", True) and size >= STREAM_FROM:
                _stream_pass(series, rx, view, size, iters, cfg, row, report, warmup=max(2, warmup))
                if series.anchors:
                    # The slot's own bandwidth, like for like with the anchors
                    # (neither reads what it moved): the receiver releases
                    # each tensor after reading its first element.
                    _stream_pass(series, rx, view, size, iters, cfg, row, report, reduce=False, warmup=2)
                    rx.post("drive")
                    try:
                        row["write_MBps"] = series.write_bandwidth(size, iters)
                    finally:
                        rx.post("stop")
                        rx.result(cfg["timeout"])  # drive
                        rx.result(cfg["timeout"])  # stop
                    # the series' own copy rate where it has one (a GPU's device-to-device copy)
                    row["memcpy_MBps"] = getattr(series, "copy_bandwidth", memcpy_bandwidth)(size)
            rows.append(row)
            if measured is not None:
                measured(row)
            progress.step(f"{name} {human_size(size)}")
    finally:
        try:
            series.s_close()
        finally:
            rx.close()


def _stream_pass(
    series: Series,
    rx: "_Receiver",
    view: Any,
    size: int,
    count: int,
    cfg: dict[str, Any],
    row: dict[str, Any],
    report: Report,
    reduce: bool = True,
    warmup: int = 0,
) -> None:
    """Back-to-back transfers with no bench ack in between: each series goes
    as fast as its own flow control lets it (a static slot of depth 2 lets the
    sender write tensor k+1 while the receiver consumes tensor k). The time
    runs from the first send to the receiver's report that it consumed the
    last tensor. `warmup` untimed transfers go first, as in the serial pass:
    the static slots' stream buffers are fresh, and the sender's first write
    into each faults in its mapping page by page (at 32 MiB that fault-in
    took longer than the ten timed transfers)."""
    name = series.name if reduce else f"{series.name} transfer-only"
    key = "stream_MBps" if reduce else "transfer_MBps"
    if warmup:
        res = _stream_round(series, rx, view, size, warmup, cfg, reduce, "stream warm-up transfer")
        if res["received"] != warmup or res["errors"]:
            report.fail(
                f"{name} stream warm-up at {human_size(size)}: receiver consumed {res['received']} "
                f"of {warmup}{': ' + res['errors'][0] if res['errors'] else ''}"
            )
    clock = time.perf_counter
    t0 = clock()
    res = _stream_round(series, rx, view, size, count, cfg, reduce, "stream transfer")
    elapsed = clock() - t0
    row["stream_iters"] = count
    row[key] = count * size / elapsed / 1e6
    if res["received"] != count:
        report.fail(f"{name} stream at {human_size(size)}: receiver consumed {res['received']} of {count}")
    for err in res["errors"]:
        report.fail(f"{name} stream at {human_size(size)}: {err}")


def _stream_round(
    series: Series, rx: "_Receiver", view: Any, size: int, count: int, cfg: dict[str, Any], reduce: bool, what: str
) -> dict[str, Any]:
    """`count` back-to-back sends into one receiver serve; the receiver's result."""
    rx.post("serve", size, count, False, True, reduce)
    stamp = getattr(series, "stamp", None)  # None: a bare double of the tests, stamped as on the host
    try:
        for k in range(count):
            if stamp is None:
                view[0] = 1.0 + k
            else:
                stamp(view, k)
            series.post()
    except Exception as e:
        raise BenchError(
            f"{what} {k} of {human_size(size)} failed: {type(e).__name__}: {first_line(e)}{rx.error_hint()}"
        ) from e
    return rx.result(cfg["timeout"] * 2 + 30)


def _oneway(
    row: dict[str, Any], res: dict[str, Any], starts: list[float], own: list[float], warmup: int, report: Report
) -> None:
    """The one-way time per transfer of the series that have one (--memory
    cuda): timed by the series itself (the cuda_ipc anchor's copy), or from
    the sender's t0 to the receiver's arrival time (recv() returned a usable
    tensor), the timed iterations' median."""
    if res.get("first_verified") is not None:
        row["first_verified"] = res["first_verified"]
    if own:
        times = own
    elif res.get("arrived") and SHARED_CLOCK:
        times = [a - t0 for a, t0 in zip(res["arrived"][warmup:], starts)]
    else:
        return
    if not times:
        return
    median = statistics.median(times)
    row["oneway_us"] = median * 1e6
    row["oneway_MBps"] = row["size"] / median / 1e6 if median > 0 else None
    check_number(report, f"{row['series']} one-way", row["oneway_us"], row["size"])


def memcpy_bandwidth(size: int, reps: int = 5) -> float:
    """MB/s of one single-thread copy of `size` bytes between two touched
    arrays (RAM to RAM once they exceed the caches): median of `reps`."""
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    clock = time.perf_counter
    times = []
    for _ in range(reps):
        t0 = clock()
        np.copyto(dst, src)
        times.append(clock() - t0)
    return size / statistics.median(times) / 1e6


def first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
