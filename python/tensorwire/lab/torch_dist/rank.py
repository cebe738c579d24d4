"""Rank side of `tensorwire bench torch-dist` (__init__.py): one backend, one process group,
every measurement of the chosen suites; rank 0 writes the results as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import tensorwire.torch  # noqa: F401 - registers "tensorwire"
from tensorwire.lab.torch_dist import WARMUP

LAT_WINDOW = 16  # osu_bw's window: sends in flight before the receiver's ack
BW_BYTES = 1 << 30  # bytes a bandwidth size moves (at least 4 windows: osu_bw repeats its window 20 times)


def _sync() -> None:
    dist.barrier()


def cma_limit(nbytes: int, iters: int) -> float:
    """MB/s of the kernel's cross-memory copy between ranks 0 and 1 with both copying at once,
    no protocol around it: windows as p2p_bandwidth's, where rank 0 writes the first half of
    each buffer into rank 1's (process_vm_writev) while rank 1 reads the second half out of
    rank 0's (process_vm_readv). What a same-host send/recv that shares the copy between the two
    processes (tensorwire's split path) can reach on this machine; measured in every round."""
    import ctypes

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    r = dist.get_rank()
    bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(LAT_WINDOW)]
    mine = torch.tensor([os.getpid()] + [b.data_ptr() for b in bufs], dtype=torch.int64)
    theirs = torch.zeros_like(mine)
    _pingpong(r, mine, theirs)
    half = nbytes // 2
    at, n = (0, half) if r == 0 else (half, nbytes - half)
    copy = libc.process_vm_writev if r == 0 else libc.process_vm_readv
    copy.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    copy.restype = ctypes.c_ssize_t
    pid = int(theirs[0])
    ack = torch.zeros(1)

    def window() -> None:
        if r > 1:
            return
        for i, b in enumerate(bufs):
            done = 0
            while done < n:  # the kernel may move less than asked
                local = IoVec(b.data_ptr() + at + done, n - done)
                remote = IoVec(int(theirs[1 + i]) + at + done, n - done)
                got = copy(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                if got <= 0:
                    raise OSError(ctypes.get_errno(), "process_vm_readv/writev failed")
                done += got
        _pingpong(r, ack, ack)  # a window ends when both halves are in: each side waits for the other

    windows = max(1, iters // LAT_WINDOW)
    window()
    _sync()
    t0 = time.perf_counter()
    for _ in range(windows):
        window()
    took = time.perf_counter() - t0
    _sync()  # neither frees its buffers while the other may still copy
    return windows * LAT_WINDOW * nbytes / took / 1e6


def p2p_latency(nbytes: int, iters: int) -> float:
    """One-way microseconds of a ping-pong between ranks 0 and 1 (osu_latency)."""
    r = dist.get_rank()
    t = torch.zeros(max(1, nbytes), dtype=torch.uint8)
    for i in range(iters // 10 + 2):  # warm-up: registrations, first touches
        _pingpong(r, t, t)
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        _pingpong(r, t, t)
    return (time.perf_counter() - t0) / iters / 2 * 1e6


def _pingpong(r: int, out: torch.Tensor, back: torch.Tensor) -> None:
    """Rank 0 sends `out` to rank 1 and receives `back` from it; rank 1 the other way round."""
    if r == 0:
        dist.send(out, 1)
        dist.recv(back, 1)
    elif r == 1:
        dist.recv(back, 0)
        dist.send(out, 0)


def p2p_bandwidth(nbytes: int, iters: int) -> float:
    """MB/s of windows of LAT_WINDOW back-to-back sends from rank 0 to 1, each window acknowledged (osu_bw)."""
    r = dist.get_rank()
    bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(LAT_WINDOW)]
    ack = torch.zeros(1)
    windows = max(1, iters // LAT_WINDOW)

    def window() -> None:
        if r == 0:
            for w in [dist.isend(b, 1) for b in bufs]:
                _started(w).wait()
            dist.recv(ack, 1)
        elif r == 1:
            for w in [dist.irecv(b, 0) for b in bufs]:
                _started(w).wait()
            dist.send(ack, 0)

    for _ in range(WARMUP):
        window()
    _sync()
    t0 = time.perf_counter()
    for _ in range(windows):
        window()
    return windows * LAT_WINDOW * nbytes / (time.perf_counter() - t0) / 1e6


def collective(op: str, nbytes: int, iters: int) -> float:
    """Average microseconds of one call (osu_allreduce and friends)."""
    n = dist.get_world_size()
    count = max(n, nbytes // 4)
    if op == "all_reduce":
        t = torch.ones(count)
        call = lambda: dist.all_reduce(t)  # noqa: E731
    elif op == "all_gather_into_tensor":
        inp, out = torch.ones(count // n), torch.empty(count // n * n)
        call = lambda: dist.all_gather_single(out, inp)  # noqa: E731
    else:
        inp, out = torch.ones(count // n * n), torch.empty(count // n)
        call = lambda: dist.reduce_scatter_single(out, inp)  # noqa: E731
    for _ in range(WARMUP):
        call()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters * 1e6


def small_resnet() -> torch.nn.Module:
    """A ResNet of four basic blocks for 32x32 images (0.7 M parameters)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.a = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                nn.BatchNorm2d(cout),
            )
            self.skip = (
                nn.Identity()
                if stride == 1 and cin == cout
                else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            )

        def forward(self, x):
            return torch.relu(self.a(x) + self.skip(x))

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        Block(32, 32, 1),
        Block(32, 64, 2),
        Block(64, 128, 2),
        Block(128, 128, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def _started(work: dist.Work | None) -> dist.Work:
    """A point-to-point op's request (None only for a rank outside the group: none here)."""
    assert work is not None
    return work


def _layers(name: str, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Sequential as a list of layers (fcn5's is its .net)."""
    seq = model.net if name == "fcn5" else model
    assert isinstance(seq, torch.nn.Sequential)
    return list(seq)


def _model(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    if name == "fcn5":
        from tensorwire.lab.paper.models import FCN5

        return FCN5(), (784,)
    return small_resnet(), (3, 32, 32)


def _moves_nothing(state, bucket):  # no annotations: DDP checks them against its own types
    """A DDP comm hook that hands every gradient bucket back as it is: no transport at all."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ddp_samples_per_s(name: str, batch: int, steps: int, sync: bool = True) -> float:
    """DDP training samples/s; sync=False: with a comm hook that moves nothing, so DDP still
    fills and unpacks its gradient buckets (as it does for every backend) but no byte travels:
    the ceiling that any backend's DDP reaches on this machine. (ddp.no_sync(), used before,
    skips the buckets too, and so overstated it.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model, shape = _model(name)
    ddp = DDP(model)
    if not sync:
        ddp.register_comm_hook(None, _moves_nothing)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * dist.get_world_size() / (time.perf_counter() - t0)


def pipe_samples_per_s(name: str, batch: int, steps: int, microbatches: int = 4) -> float:
    """GPipe over the ranks: the model's Sequential cut into equal runs of layers, one per rank."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    model, shape = _model(name)
    layers = _layers(name, model)
    r, n = dist.get_rank(), dist.get_world_size()
    per = -(-len(layers) // n)
    stage = PipelineStage(torch.nn.Sequential(*layers[r * per : (r + 1) * per]), r, n, torch.device("cpu"))
    sched = ScheduleGPipe(
        stage, n_microbatches=microbatches, loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y)
    )
    x, y = torch.randn(batch * microbatches, *shape), torch.randint(0, 10, (batch * microbatches,))

    def step() -> None:
        if r == 0:
            sched.step(x)
        elif r == n - 1:
            sched.step(target=y)
        else:
            sched.step()

    for _ in range(WARMUP):
        step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * microbatches / (time.perf_counter() - t0)


def pipe_ceiling_samples_per_s(name: str, batch: int, microbatches: int = 4) -> float:
    """GPipe's compute ceiling: every rank times its own stage's forward and backward of one
    microbatch (all ranks at once, as in the pipeline); a GPipe step takes at least
    (microbatches + ranks - 1) x the slowest stage's time, whatever moves the activations."""
    torch.manual_seed(0)
    model, shape = _model(name)
    layers = _layers(name, model)
    r, n = dist.get_rank(), dist.get_world_size()
    per = -(-len(layers) // n)
    stage = torch.nn.Sequential(*layers[r * per : (r + 1) * per])
    x = torch.randn(batch, *shape)
    with torch.no_grad():
        for layer in layers[: r * per]:
            x = layer(x)
    x.requires_grad_(r > 0)

    def once() -> None:
        stage(x).float().sum().backward()

    once()
    _sync()
    t0 = time.perf_counter()
    for _ in range(microbatches):
        once()
    slowest = torch.tensor([(time.perf_counter() - t0) / microbatches])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return batch * microbatches / ((microbatches + n - 1) * float(slowest))


def dispatch_us(iters: int, batch: int = 16) -> float:
    """Microseconds from dist.isend's call to its return, 8 B eager sends posted back to back
    (batches of `batch`, fewer than the ring's credits): the backend's cost per op before the wire."""
    r = dist.get_rank()
    t = [torch.zeros(2) for _ in range(batch)]
    total, count = 0.0, 0
    for _ in range(max(1, iters // batch)):
        _sync()
        if r == 0:
            t0 = time.perf_counter()
            works = [dist.isend(x, 1) for x in t]
            total += time.perf_counter() - t0
            count += batch
            for w in works:
                _started(w).wait()
        elif r == 1:
            for x in t:
                dist.recv(x, 0)
    return total / max(1, count) * 1e6


def dispatch_floor_us(iters: int = 500) -> float:
    """dispatch_us's loop on torch's own fake backend (torch.testing's FakeProcessGroup, which moves
    nothing and returns a finished Work), one process as rank 0 of 2: what torch.distributed's
    Python layer costs per isend before any backend runs, the floor of every backend's dispatch."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        return min(dispatch_us(iters) for _ in range(3))
    finally:
        dist.destroy_process_group()


def background_ms(nbytes: int = 16 << 20, compute_s: float = 1.0) -> float:
    """Milliseconds from rank 0's dist.isend of `nbytes` to rank 1's recv returning, while rank 0
    computes for `compute_s` (one thread of matmuls) without waiting on the send: a backend that
    moves a message only while its sender waits needs the whole `compute_s` (issue 48)."""
    r = dist.get_rank()
    x = torch.ones(nbytes // 4) if r == 0 else torch.zeros(nbytes // 4)
    a = torch.rand(256, 256)
    _sync()
    t0 = time.perf_counter()
    if r == 0:
        work = dist.isend(x, 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the other CPU is the receiver's
        while time.perf_counter() - t0 < compute_s:
            a = a @ a
            a /= a.norm()
        torch.set_num_threads(threads)
        _started(work).wait()
        took = torch.zeros(1)
    else:
        dist.recv(x, 0)
        took = torch.tensor([(time.perf_counter() - t0) * 1e3])
        assert float(x[0]) == 1.0 and float(x[-1]) == 1.0, "the message did not land whole"
    dist.all_reduce(took)  # rank 1's time, on rank 0 too
    return float(took)


def main() -> None:
    p = argparse.ArgumentParser()
    if sys.argv[1:] == ["--dispatch-floor"]:  # one process, no peers: print the floor and leave
        print(json.dumps({"dispatch-floor/isend": dispatch_floor_us()}))
        return
    p.add_argument("--backend", required=True)
    p.add_argument("--suite", required=True)
    p.add_argument("--lat-sizes", required=True)
    p.add_argument("--bw-sizes", required=True)
    p.add_argument("--coll-sizes", required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group(a.backend)
    suite = a.suite.split(",")
    sizes = {
        k: [int(s) for s in v.split(",") if s]
        for k, v in (("lat", a.lat_sizes), ("bw", a.bw_sizes), ("coll", a.coll_sizes))
    }
    res: dict = {}
    if "p2p" in suite:
        for s in sizes["lat"]:
            res[f"latency/{s}"] = p2p_latency(s, a.iters)
        for s in sizes["bw"]:
            res[f"bandwidth/{s}"] = p2p_bandwidth(s, max(4 * LAT_WINDOW, min(a.iters, BW_BYTES // s)))
        for s in sizes["bw"]:
            if s >= 1 << 20:
                res[f"cma-limit/{s}"] = cma_limit(s, max(4 * LAT_WINDOW, min(a.iters, BW_BYTES // s)))
        if a.backend == "tensorwire":
            res["dispatch/isend"] = dispatch_us(min(a.iters, 500))
        res["background/16777216"] = background_ms()
    if "coll" in suite:
        for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            for s in sizes["coll"]:
                res[f"{op}/{s}"] = collective(op, s, max(3, min(a.iters, (512 << 20) // s)))
    if "ddp" in suite:
        for m in ("fcn5", "resnet"):
            res[f"ddp/{m}"] = ddp_samples_per_s(m, 8, a.steps)
            res[f"ddp-ceiling/{m}"] = ddp_samples_per_s(m, 8, a.steps, sync=False)
    if "pipe" in suite:
        for m in ("fcn5", "resnet"):
            res[f"pipe/{m}"] = pipe_samples_per_s(m, 8, a.steps)
            res[f"pipe-ceiling/{m}"] = pipe_ceiling_samples_per_s(m, 8)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: a gloo rank that ran GPipe aborts there
    # about 1 run in 5 ("terminate called without an active exception", torch 2.13, after
    # every number is taken), which made bench/results/torch_dist_*.txt at feb942d keep only
    # 1 of 3 gloo rounds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
