"""`tensorwire bench tensor`: moving one tensor from one process to another,
tensorwire's slots against the usual ways (the paper's Figure 7).

Series (all measured in the same run, same sizes, same method):

  zerocopy  tensorwire static slot; the sender's tensor lives in registered memory
            (device.empty), so the bytes go straight from it into the receiver's slot.
  dynamic   tensorwire dynamic slot (any shape; the receiver allocates per message).
  copy      tensorwire static slot; the sender's tensor is an ordinary numpy array,
            copied into the registered pool before the one-sided write.
  rpc-ucx   an RPC on the fast transport: the tensor (with a dtype/shape header) is
            serialized into a request message (a copy), sent with UCX active messages,
            received into the server's message buffer and copied out into a numpy
            array; the AM reply is the ack. Raw UCX on its own context and worker.
  grpc      a real gRPC (grpcio) unary call over loopback TCP: request = header +
            tensor bytes, the server views the request bytes as a numpy array, the
            response is the ack. gRPC has no shared-memory transport: always tcp.
  socket    a plain TCP socket from Python: sendall from the tensor, recv_into a
            preallocated numpy array, one byte back is the ack (the floor any user
            has without a library). Always tcp.
  ucx-tag   UCX tagged send/recv (eager or rendezvous by size, what MPI and UCXX do)
            into a preallocated numpy array; a small tagged message back is the ack.
  gloo      torch.distributed gloo send/recv into a preallocated tensor; a
            1-element tensor back is the ack. Gloo runs over TCP: always tcp.

Measurement (identical for every series): per iteration the sender takes t0,
sends the tensor; the receiver receives it into a usable numpy array, consumes
it (a max-reduction, ndarray.max()) and acknowledges with a tiny message by the
series' own mechanism (static slots: slot.release -> sender.wait_consumed; gRPC:
the unary response; gloo: a 1-element tensor; socket: one byte; ucx-tag: a small tag message;
rpc-ucx: the AM reply); the sender takes t1 when the ack arrives; the sample is
t1 - t0. One exception, from the dynamic-slot API: its ack is sent when
dslot.recv() returns, before the receiver's max-reduction, so `dynamic` samples
do not include the consume. Warm-up iterations run first, untimed; iterations per
size are capped by a byte budget (common.iterations_for). The reported time is
the median of the samples; MB/s = size / median (MB = 10^6 B); the speed-up of
zerocopy over series X at a size is median(X) / median(zerocopy).

The tensor is float32, 1-D. Its element 0 is set to 1 + k before the k-th send
(outside the timed region) and every other element is below 1, so the
receiver's max-reduction doubles as a cheap check that each transfer delivered
the new tensor; --verify also compares every element (timings then include the
comparison). Buffers of the baselines are reused between iterations (no page
faults in the timed loop), which favours the baselines, not tensorwire.
Because only element 0 changes, a series whose receiver copies the bytes
(ucx-tag, dynamic) may find most lines of the sender's tensor already cached
on its own core from the previous iteration, while a push (zerocopy) always
hands over lines dirty in the sender's cache. --refresh rewrites the whole
tensor (same values, untimed) before each transfer, as a producer that
computes a new tensor every step would.

Each series gets a fresh receiver process (multiprocessing "spawn"), driven
through a pipe that is never on the timed path. Everything runs on 127.0.0.1.

--memory cuda moves a tensor from GPU memory to GPU memory instead: series
zerocopy, dynamic, staged, gloo and the cuda_ipc anchor, the same harness with
torch tensors for numpy arrays, and each row's one-way time (see cuda.py).

The package, one job per file:

  base        constants, the tensor's contents and header, the Series base class
  slots       zerocopy, copy (StaticSeries) and dynamic, over _TwSeries
  ucx         rpc-ucx and ucx-tag, over _UcxSeries (tensorwire._core.UcxBaseline)
  grpc_call   grpc
  tcp_socket  socket
  gloo        gloo
  cuda        --memory cuda: the GPU forms of zerocopy, dynamic, gloo; staged, cuda_ipc
  registry    SERIES, CUDA_SERIES (name -> Series class), series_class, select_series
  harness     the receiver process, the checks, the serial and stream passes of one series
  report      best of the passes, speed-ups, targets, the table (its header, a row, what
              follows it) and the plot
  (here)      run_tensor, the sweep: each cell's row printed when its last pass measured it
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from ..common import Progress, Report, bind_cpu, pick_cpus, print_line
from .base import (
    DEFAULT_SIZES,
    DTYPE,
    HOST,
    ITEM,
    START_TIMEOUT_S,
    STREAM_FROM,
    WRITE_ANCHOR_FROM,
    Series,
    decode_meta,
    encode_meta,
    fill_pattern,
)
from .cuda import CudaDynamic, CudaGloo, CudaIpc, CudaZeroCopy, Staged, cuda_unavailable
from .gloo import Gloo
from .grpc_call import GRPC_METHOD, GRPC_OPTIONS, Grpc
from .harness import CHILD_ENV, first_line, run_series, bench_spin_us, memcpy_bandwidth, warmup_for
from .registry import CUDA_SERIES, SERIES, SERIES_ORDER, select_series, series_class, series_order
from .report import (
    CUDA_TARGETS,
    TARGETS,
    expectations,
    print_report,
    speedups,
    best_of,
    open_table,
    plot,
    print_tail,
    row_line,
    table_order,
    targets,
)
from .slots import Copy, Dynamic, StaticSeries, ZeroCopy
from .tcp_socket import Socket
from .ucx import TAG_ACK, TAG_DATA, RpcUcx, UcxTag

__all__ = [
    "CHILD_ENV",
    "CUDA_SERIES",
    "CUDA_TARGETS",
    "DEFAULT_SIZES",
    "DTYPE",
    "GRPC_METHOD",
    "GRPC_OPTIONS",
    "HOST",
    "ITEM",
    "SERIES",
    "SERIES_ORDER",
    "START_TIMEOUT_S",
    "STREAM_FROM",
    "TAG_ACK",
    "TAG_DATA",
    "TARGETS",
    "WRITE_ANCHOR_FROM",
    "Copy",
    "CudaDynamic",
    "CudaGloo",
    "CudaIpc",
    "CudaZeroCopy",
    "Dynamic",
    "Gloo",
    "Grpc",
    "RpcUcx",
    "Series",
    "Socket",
    "Staged",
    "StaticSeries",
    "UcxTag",
    "ZeroCopy",
    "best_of",
    "cuda_unavailable",
    "decode_meta",
    "encode_meta",
    "fill_pattern",
    "memcpy_bandwidth",
    "plot",
    "run_tensor",
    "select_series",
    "series_class",
    "series_order",
    "targets",
    "warmup_for",
]


def run_tensor(args) -> Report:
    """Runs the sweep described by the CLI arguments (see tensorwire/lab/commands/bench_tensor.py)."""
    sizes = args.sizes
    bad = [s for s in sizes if s % ITEM]
    if bad:
        raise ValueError(f"sizes must be multiples of {ITEM} B (float32 tensors): {bad}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so before the sweep, not after
        raise ModuleNotFoundError(
            "--plot needs matplotlib: pip install matplotlib (or tensorwire[bench])", name="matplotlib"
        )
    explicit = bool(args.series)
    memory = getattr(args, "memory", "host")
    names = select_series(args.series, memory)
    cfg = {
        "transport": args.transport,
        "timeout": float(args.timeout),
        "max_size": max(sizes),
        "progress": getattr(args, "progress_mode", "inline"),
        "memory": memory,
        "spin_us": bench_spin_us() if getattr(args, "spin_us", None) is None else int(args.spin_us),
        "cpus": pick_cpus(getattr(args, "cpus", "auto"), 2),
    }
    method = (
        "median over iterations of t(send) -> t(ack after the receiver's max-reduction), best of "
        "--repeat passes; see tensorwire.lab.fabric.tensor"
    )
    if memory == "cuda":
        method += (
            " and tensorwire.lab.fabric.tensor.cuda; one-way: t(send) -> t(recv returned the GPU tensor), "
            "the host's monotonic clock on both sides (cuda_ipc: its timed copy + synchronize)"
        )
    report = Report(
        "tensor",
        {
            "transport": args.transport,
            "memory": memory,
            "sizes": sizes,
            "iters": args.iters,
            "budget": args.budget,
            "warmup": args.warmup,
            "verify": bool(args.verify),
            "refresh": bool(getattr(args, "refresh", False)),
            "progress": cfg["progress"],
            "spin_us": cfg["spin_us"],
            "cpus": cfg["cpus"],
            "series": names,
            "dtype": "float32",
            "unit": "usec, MB/s (10^6 B/s)",
            "method": method,
        },
    )
    unavailable: dict[str, str] = {}
    runnable = []
    for name in names:
        why = series_class(name, memory).unavailable()
        if why and explicit:  # asked for by name: refused before anything runs (exit 2)
            raise SystemExit(f"tensorwire bench tensor: series {name} cannot run here: {why}")
        if why:
            unavailable[name] = why
            print(f"tensorwire bench tensor: skipping {name}: {why}", file=sys.stderr)
        else:
            runnable.append(name)
    report.config["unavailable"] = unavailable
    repeat = max(1, int(getattr(args, "repeat", 1) or 1))
    report.config["repeat"] = repeat
    runs: list[dict[str, Any]] = []
    progress = Progress(len(runnable) * len(sizes) * repeat, "tensor")
    table = open_table(report, args, progress)
    printed: set[tuple[str, int]] = set()

    def print_cell(measured: dict[str, Any]) -> None:
        key = (measured["series"], measured["size"])
        rows = best_of(runs)
        speedups(rows)
        table.line(row_line(next(r for r in rows if (r["series"], r["size"]) == key), memory == "cuda"))
        printed.add(key)

    # Sender and receiver on CPUs of their own (--cpus): left to the scheduler, the two at times
    # share one CPU for a whole series, each transfer then waiting for a context switch
    # (bench/results/tensor_cpus.txt).
    had = bind_cpu(cfg["cpus"][0] if cfg["cpus"] else None)
    try:
        _passes(runnable, sizes, repeat, cfg, args, progress, runs, report, print_cell)
    finally:
        os.sched_setaffinity(0, had)
    rows = best_of(runs)
    speedups(rows)
    for r in table_order(rows, memory):  # cells the last pass did not reach (their series failed)
        if (r["series"], r["size"]) not in printed:
            table.line(row_line(r, memory == "cuda"))
    expectations(report, rows)
    report.rows = rows
    # Performance bars are reported (MISS lines, JSON), not folded into the
    # verdict: the verdict says whether the run was sound (every tensor arrived
    # intact), which must not depend on how busy the machine was.
    report.config["targets"] = targets(rows, args.transport, memory)
    print_tail(report, args, table)
    if args.plot and rows:
        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return report


def _passes(
    runnable: list[str],
    sizes: list[int],
    repeat: int,
    cfg: dict[str, Any],
    args,
    progress: Progress,
    runs: list[dict[str, Any]],
    report: Report,
    print_cell: Any,
) -> None:
    """Whole passes, series interleaved: each sees the machine's modes alike. A cell's row is
    printed when the last pass measured it: its best is known then (and zerocopy's, measured
    first, for the speed-up)."""
    for last in [False] * (repeat - 1) + [True]:
        for name in list(runnable):
            before = progress.done
            try:
                run_series(name, cfg, args, progress, runs, report, print_cell if last else None)
            except Exception as e:  # one broken series must not take the others down
                report.fail(f"{name}: {type(e).__name__}: {first_line(e)}")
                print_line(f"tensorwire bench tensor: {name} failed: {e}", sys.stderr, progress)
                runnable.remove(name)  # not again in the later passes
                progress.total -= len(sizes) * repeat - (progress.done - before)
