"""`tensorwire bench tensor`: tensor transfer + consume, tensorwire's slots beside
RPC over UCX, gRPC, UCX tag and gloo (tensorwire.lab.fabric.tensor; the paper's Figure 7);
with --memory cuda from GPU memory to GPU memory (tensorwire.lab.fabric.tensor.cuda)."""

from __future__ import annotations

import argparse

from ... import TRANSPORTS
from .args import PLOT_NEEDS, add_progress_switch, arg_nonneg, arg_positive as _positive, arg_sizes as _sizes


def _series(text: str) -> str:
    from ..fabric.tensor import select_series

    try:  # a name of either memory here; _main checks it against --memory
        return ",".join(select_series(text, None))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


TENSOR_HELP = """\
Moves one float32 tensor per iteration from this process to a receiver process
(spawned on 127.0.0.1), where it is consumed (a max-reduction), and compares
tensorwire's tensor slots with the usual ways of doing it (the paper's Figure 7).

Series (default: all that are available here):
  zerocopy  tensorwire static slot, sender tensor in registered memory
  dynamic   tensorwire dynamic slot (any shape; receiver allocates)
  copy      tensorwire static slot, sender tensor copied into the pool first
  rpc-ucx   RPC over UCX active messages: serialize, send, copy out at the receiver
  grpc      gRPC (grpcio) unary call over TCP carrying the tensor bytes
  ucx-tag   UCX tagged send/recv (rendezvous for large sizes), as MPI and UCXX do
  gloo      torch.distributed gloo send/recv (needs torch)
grpc and gloo always use TCP; the others use --transport.

With --memory cuda the tensor starts in the sender's GPU memory and must end in
the receiver's (one GPU is enough: two processes on it). Series:
  zerocopy  tensorwire static slot in GPU memory, sender tensor a CUDA Block
  dynamic   tensorwire dynamic slot in GPU memory
  staged    GPU -> pinned host, host static slot, host -> GPU ("GDR off")
  gloo      gloo send/recv through pinned host copies (gloo has no CUDA send/recv)
  cuda_ipc  anchor: a copy into the receiver's buffer through a CUDA IPC handle
Each row also has a one-way time: send -> tensor usable at the receiver
(cuda_ipc: its copy + synchronize). Needs torch with a CUDA GPU.

Each sample: sender takes t0, sends; receiver gets a usable array, reduces it,
acks by the series' own mechanism; sender takes t1 on the ack. Reported: median
per transfer, MB/s (10^6 B/s) and zerocopy's speed-up over every other series
(series time / zerocopy time). Warm-up iterations are untimed; --budget caps the
bytes moved per size and series (at least 10 iterations). The series run one
after the other, each over every size, and a row is printed as soon as it is
measured (with --repeat, in the last pass, when the cell's best is known).

examples:
  tensorwire bench tensor --transport shm --sizes 4K,1M,16M
  tensorwire bench tensor --transport tcp --series zerocopy,grpc --plot fig7.png
  tensorwire bench tensor --sizes 1K:1G --json tensor.json --verify
  tensorwire bench tensor --memory cuda --sizes 4K,64M,256M --json tensor_cuda.json
"""


def register(commands) -> None:
    tensor = commands.bench.add_parser(
        "tensor",
        help="tensor transfer + consume: slots vs RPC, gRPC, UCX tag, gloo (Figure 7)",
        description=TENSOR_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tensor.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="transport of the tensorwire and UCX series: tcp, shm, rdma or auto (UCX_TLS as set)",
    )
    tensor.add_argument(
        "--sizes",
        type=_sizes,
        default=_sizes("1K:256M"),
        help="tensor sizes in bytes: a list like 4K,1M,16M or a range like 1K:1G (default 1K:256M)",
    )
    tensor.add_argument(
        "--memory",
        choices=("host", "cuda"),
        default="host",
        help="where the tensors live: host (default) or cuda: GPU memory to GPU memory "
        "(series zerocopy, dynamic, staged, gloo, cuda_ipc; needs torch with a CUDA GPU)",
    )
    tensor.add_argument(
        "--series",
        type=_series,
        default=None,
        help="comma-separated series to run (default: all of --memory's): "
        "zerocopy,dynamic,copy,rpc-ucx,grpc,socket,ucx-tag,gloo; "
        "with --memory cuda zerocopy,dynamic,staged,gloo,cuda_ipc",
    )
    tensor.add_argument("--iters", type=_positive, default=100, help="timed iterations per size (default 100)")
    tensor.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="passes over every series and size, interleaved; each cell reports its best pass "
        "(lowest median; rows print during the last pass), the others' medians kept in the "
        "JSON (default 1)",
    )
    tensor.add_argument(
        "--warmup",
        type=arg_nonneg,
        default=None,
        help="untimed iterations before each size (default: a tenth of --iters, more for "
        "small sizes: up to 200, at most an eighth of --budget)",
    )
    tensor.add_argument(
        "--budget",
        type=_sizes,
        default=[256 << 20],
        metavar="BYTES",
        help="cap on bytes moved per size and series; lowers --iters (default 256M)",
    )
    tensor.add_argument("--timeout", type=float, default=60.0, help="seconds any one step may take (default 60)")
    tensor.add_argument(
        "--spin-us",
        type=int,
        default=None,
        metavar="US",
        help="how long a waiter (tensorwire devices, UCX baselines) polls before it sleeps on the "
        "worker's event fd (default: that of bench latency/bw, 100)",
    )
    tensor.add_argument(
        "--cpus",
        default="auto",
        metavar="auto|none|A,B",
        help="CPUs of the sender and the receiver, one each: auto (default: the first two "
        "this process may use, when it may use two), none (the scheduler places them: it "
        "at times puts both on one CPU for a whole series, every transfer then waiting for "
        "a context switch) or two CPU numbers",
    )
    tensor.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="skip the stream passes (from 1 MiB up: back-to-back transfers with no bench ack, "
        "each series paced by its own flow control) and the memcpy/write anchors",
    )
    tensor.add_argument(
        "--verify", action="store_true", help="compare every element of every received tensor (timings then include it)"
    )
    tensor.add_argument(
        "--progress-mode",
        choices=("inline", "blocking", "polling"),
        default="inline",
        help="progress mode of the tensorwire devices (default inline: the waiter drives "
        "progress; blocking is the Device default: a progress thread that sleeps when idle)",
    )
    tensor.add_argument(
        "--refresh",
        action="store_true",
        help="the sender rewrites the whole tensor (same values) before each timed transfer, "
        "untimed, like a producer that computes a new tensor every step; by default only "
        "its first element changes, so the series that pull (ucx-tag, dynamic) may read "
        "lines already cached on the receiver's core",
    )
    tensor.add_argument(
        "--json", metavar="FILE", help="write the report: rows {series, transport, size, iters, median_us, MBps, ...}"
    )
    tensor.add_argument("--plot", metavar="FILE.png", help="log-log plot, one line per series (needs matplotlib)")
    add_progress_switch(tensor)
    tensor.set_defaults(func=_main, needs=(PLOT_NEEDS,))


def _main(args: argparse.Namespace) -> int:
    import importlib.util

    from ..fabric.common import pick_cpus
    from ..fabric.tensor import cuda_unavailable, run_tensor, select_series
    from ...config import export_progress_bar

    bad = [s for s in args.sizes if s % 4]
    if bad:  # the check of every --sizes is the parser's; this one is the command's
        raise SystemExit(f"tensorwire bench tensor: sizes must be multiples of 4 B (float32 tensors), not {bad}")
    if args.series:  # the parser took a name of either memory
        try:
            select_series(args.series, args.memory)
        except ValueError as e:
            raise SystemExit(f"tensorwire bench tensor: {e}") from None
    try:
        pick_cpus(args.cpus, 2)
    except ValueError as e:
        raise SystemExit(f"tensorwire bench tensor: {e}") from None
    if args.memory == "cuda":  # before any receiver is spawned: say it once, exit 2
        if importlib.util.find_spec("torch") is None:
            raise SystemExit("tensorwire bench tensor --memory cuda needs torch: pip install tensorwire[torch]")
        why = cuda_unavailable()
        if why:
            raise SystemExit(f"tensorwire bench tensor --memory cuda needs a CUDA GPU ({why})")
    args.budget = args.budget[0]
    export_progress_bar(args.progress)
    report = run_tensor(args)
    report.write_json(args.json)
    return 0 if report.verdict != "FAIL" else 2
