"""`tensorwire train`, `tensorwire bench train` and `tensorwire partition` (listed in
tensorwire.lab.commands's COMMAND_MODULES; importing this module must stay cheap: torch is
imported inside the commands, which declare it in `needs`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ... import TRANSPORTS
from ..paper.runs import MODES, mean_step_times, device_error, render_result, time_to_target, train_once
from .args import PLOT_NEEDS, add_progress_switch, arg_counts, arg_nonneg, arg_positive as _positive

MODEL_NAMES = ("alexnet", "inception3", "vgg16", "lstm", "gru", "fcn5", "widedeep", "mlp")

TRAIN_HELP = """\
Data-parallel training in the parameter-server architecture (the paper's §5.2):
W worker processes and S server processes on this machine (--colocate: worker r
and server r share process r, the paper's layout); the model's variables
are placed on the servers balanced by size (--placement round-robin: the paper's
order). Each synchronous SGD step: the workers
compute gradients of their batch (compute), push each gradient into a static slot
on its variable's server (push); a server sums the W gradients, averages them and
applies the optimizer (aggregate), then writes the new values straight into every
worker's parameter memory (pull).

Modes:
  zerocopy  parameters, gradients and the servers' master copies live in registered
            memory, allocated once (nn.Linear backward writes its gradients there
            directly); pushes and pulls copy nothing
  copy      the same, but each tensor sent is first copied into a registered
            staging block (the paper's "graph analysis turned off")
  gloo      the same algorithm over torch.distributed (gloo) send/recv (RPC-style
            baseline; always TCP)

Devices: --device cpu (default) computes on the CPU. --device cuda (or cuda:N)
runs every worker and server on that GPU (zerocopy and copy): parameters,
gradients and the servers' master copies live in GPU memory and the servers
apply their updates there. --gdr on (the default there) registers that GPU
memory and moves it as is (the paper's GPUDirect RDMA); --gdr off stages every
tensor that moves through host memory: a GPU-to-host copy, the host transfer,
a host-to-GPU copy (the paper's Table 2 baseline; `bench train --figures table2`
compares the two). Without a GPU, --device cuda exits 2.

Models (tensorwire train --list prints their sizes beside the paper's Table 1):
  alexnet inception3 vgg16 lstm gru fcn5   the paper's six benchmarks
  widedeep   wide-and-deep with sparse embedding gradients (dynamic slots)
  mlp        a small classifier (with --data digits: the convergence run)

Data: synthetic batches generated on the fly (default; as in the paper), or
--data digits (scikit-learn's digits dataset; needs scikit-learn). CNN images are
--image-size pixels square: smaller than the paper's 224/299 by default so that
CPU steps stay short (with --device cuda: the paper's); the variables, and so the bytes moved per step, are the
paper's whatever the image size (the CNNs pool adaptively before their dense layers).

Output: samples/s (all workers; warm-up steps excluded), the mean per-step split
as seen by the workers (compute, push, aggregate = from the last push until the
first parameter arrives, pull = until all arrived) and by the servers (wait for
gradients, sum, optimizer, sending parameters), bytes copied and sent per step.

Under torchrun or mpirun (RANK/WORLD_SIZE or OMPI_COMM_WORLD_RANK/SIZE set, and
MASTER_ADDR/MASTER_PORT), every process runs one role: ranks 0..S-1 are servers,
S..S+W-1 workers (WORLD_SIZE must be S+W); server addresses meet in the c10d
store at MASTER_ADDR:MASTER_PORT. --launch local forces the local launcher.

examples:
  tensorwire train --list
  tensorwire train --model fcn5 --workers 2 --servers 2 --batch 8 --steps 50 --mode zerocopy --transport shm
  tensorwire train --model vgg16 --batch 1 --steps 10 --mode copy --transport tcp --json vgg.json
  tensorwire train --model alexnet --batch 1 --mode gloo --colocate
  tensorwire train --model mlp --data digits --steps 300 --lr 0.5 --target-loss 0.3 --plot digits.png
  tensorwire train --model fcn5 --device cuda --gdr off --transport tcp --steps 20
  torchrun --nproc-per-node 4 -m tensorwire train --model fcn5 --workers 2 --servers 2
"""

BENCH_HELP = """\
Sweeps the parameter-server training (the paper's Figures 8, 10 and 11) on this
machine, each configuration a short `tensorwire train` run (synthetic data):

  fig8   models x batch sizes x modes: samples/s (--models, --batches, --modes);
         beside it the transport floor of each model, the targets' anchor (tcp:
         plain sockets moving the same bytes; shm: one memcpy per byte; no
         compute) and the samples/s it bounds
  fig10  workers 1..N (servers = workers, as in the paper) for --scale-models
  fig11  zero-copy on/off: mean step time of zerocopy vs copy at --copy-batch
  convergence  (only when asked) the mlp on scikit-learn's digits, 2 workers x 2
         servers in each mode and one process: loss curves, time to --target-loss
  table2 (only when asked; needs a CUDA GPU) the paper's Table 2: mean mini-batch
         time of --models (zerocopy, --workers x --workers, --table2-batch) on the
         GPU with GDR off vs on, beside the paper's published improvements

Output: the tables on stdout (redirect or tee them to keep them), Figure 8's
rows as each (model, batch) finishes, the rest when the sweep ends; each run's
result on stderr as it finishes. --json FILE writes every run; --plot FILE.png
draws every figure that ran into one PNG, one panel per figure (matplotlib).
Nothing is written unless asked.

examples:
  tensorwire bench train --transport shm --json train_shm.json --plot train_shm.png | tee train_shm.txt
  tensorwire bench train --models fcn5 --batches 1,8 --figures fig8 --steps 8
  tensorwire bench train --figures convergence --plot convergence.png
  tensorwire bench train --figures table2 --models fcn5 --steps 6 --json gdr.json
"""


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (got {text!r})")
        return items

    return parse


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="shm",
        help="tensorwire transport of zerocopy/copy (gloo is always TCP); default shm",
    )
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=("sgd", "adam", "adamw", "adagrad", "rmsprop"),
        help="torch.optim optimizer the servers apply (default sgd)",
    )
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    p.add_argument(
        "--image-size",
        type=int,
        default=0,
        help="CNN input size in pixels (default: alexnet 96, vgg16 32, inception3 75; the paper's "
        "224/299 make CPU steps long; with --device cuda the paper's); the variables do not "
        "change with it",
    )
    p.add_argument("--seq-len", type=int, default=0, help="RNN steps (default 80, the paper's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial values and the data")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds a step or the setup may take before the run fails (default 120)",
    )
    p.add_argument(
        "--placement",
        choices=("balanced", "round-robin"),
        default="balanced",
        help="variables on servers: balanced by size (default) or round-robin in model order (the "
        "paper's; with 2 servers it puts every weight on server 0)",
    )
    p.add_argument(
        "--colocate",
        action="store_true",
        help="the paper's layout: one process per worker that also runs the server of its rank "
        "(servers = workers); a worker's share of the variables stays in its process, every mode "
        "alike (default: separate server and worker processes)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="{cpu,cuda,cuda:N}",
        help="where workers and servers compute and keep parameters and gradients (default cpu); "
        "cuda needs a CUDA GPU (exit 2 without)",
    )
    p.add_argument(
        "--gdr",
        choices=("on", "off"),
        default=None,
        help="with --device cuda: on (default) moves registered GPU memory directly (GPUDirect RDMA); "
        "off stages every tensor through host memory (GPU->host copy, host transfer, host->GPU)",
    )


def register(commands) -> None:
    t = commands.top.add_parser(
        "train",
        help="parameter-server training: zero-copy parameters and gradients (Figure 8)",
        description=TRAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--list", action="store_true", help="print the models with the paper's Table 1 numbers and exit")
    t.add_argument("--model", choices=MODEL_NAMES, default="fcn5", help="model to train (default fcn5)")
    t.add_argument("--workers", type=_positive, default=2, help="worker processes W (default 2)")
    t.add_argument("--servers", type=_positive, default=2, help="server processes S (default 2)")
    t.add_argument("--batch", type=_positive, default=8, help="batch size per worker (default 8)")
    t.add_argument("--steps", type=_positive, default=50, help="training steps (default 50)")
    t.add_argument("--warmup", type=arg_nonneg, default=2, help="first steps left out of the timings (default 2)")
    t.add_argument("--mode", choices=MODES, default="zerocopy", help="zerocopy (default), copy or gloo")
    t.add_argument(
        "--data",
        choices=("synthetic", "digits"),
        default="synthetic",
        help="synthetic batches made on the fly (default) or scikit-learn's digits (mlp only)",
    )
    t.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="report the time and step at which the loss (mean of 10 steps) first fell below this",
    )
    t.add_argument(
        "--launch",
        choices=("auto", "local"),
        default="auto",
        help="auto: one role per process under torchrun/mpirun, else spawn all locally (default)",
    )
    t.add_argument("--json", metavar="FILE", help="write the result as JSON (samples_per_s, split, losses, ...)")
    t.add_argument("--plot", metavar="FILE.png", help="plot the loss curve and the per-step split (matplotlib)")
    add_progress_switch(t)  # rank 0's worker draws one step per training step
    _common(t)
    t.set_defaults(func=run_train, needs=(("torch", "torch"), ("matplotlib", "train", "plot")))

    b = commands.bench.add_parser(
        "train",
        help="PS training sweep: models x batches x modes, scaling, zero copy on/off",
        description=BENCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument(
        "--models",
        type=_csv(MODEL_NAMES),
        default=["fcn5", "alexnet", "vgg16"],
        help="models of fig8/fig11 (default fcn5,alexnet,vgg16: the communication-bound ones)",
    )
    b.add_argument("--batches", type=arg_counts, default=[1, 8], help="batch sizes per worker of fig8 (default 1,8)")
    b.add_argument("--modes", type=_csv(MODES), default=list(MODES), help="modes of fig8 (default all)")
    b.add_argument("--workers", type=_positive, default=2, help="workers (= servers) of fig8/fig11 (default 2)")
    b.add_argument("--scale-models", type=_csv(MODEL_NAMES), default=["fcn5"], help="models of fig10 (default fcn5)")
    b.add_argument("--scale", type=arg_counts, default=[1, 2], help="worker counts of fig10 (default 1,2)")
    b.add_argument("--scale-batch", type=_positive, default=8, help="batch of fig10 (default 8)")
    b.add_argument("--copy-batch", type=_positive, default=8, help="batch of fig11 (default 8, as the paper)")
    b.add_argument(
        "--figures",
        type=_csv(("fig8", "fig10", "fig11", "convergence", "table2")),
        default=["fig8", "fig10", "fig11"],
        help="which sweeps to run (default fig8,fig10,fig11); convergence: the mlp on scikit-learn's "
        "digits with 2 workers x 2 servers in every mode and in one process, time to --target-loss; "
        "table2: GDR off vs on on a CUDA GPU (the paper's Table 2)",
    )
    b.add_argument("--table2-batch", type=_positive, default=8, help="batch per worker of table2 (default 8)")
    b.add_argument("--conv-steps", type=_positive, default=300, help="steps of the convergence runs (default 300)")
    b.add_argument("--conv-batch", type=_positive, default=16, help="batch per worker of the convergence runs")
    b.add_argument("--conv-lr", type=float, default=0.5, help="SGD learning rate of the convergence runs")
    b.add_argument(
        "--target-loss", type=float, default=0.2, help="convergence target: running mean of 10 losses (default 0.2)"
    )
    b.add_argument("--steps", type=_positive, default=10, help="steps per run (default 10)")
    b.add_argument("--warmup", type=arg_nonneg, default=2, help="warm-up steps per run (default 2)")
    b.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="runs per configuration, going round the modes compared (a, b, a, b, ...); the best of "
        "each is kept (default 1)",
    )
    b.add_argument(
        "--json",
        metavar="FILE",
        help="write every run as JSON: {config, fig8, fig10, fig11, floor, convergence, table2, ...}",
    )
    b.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw every figure that ran into one PNG, one panel per figure (needs matplotlib)",
    )
    _common(b)
    b.set_defaults(func=run_bench, needs=(("torch", "train"), PLOT_NEEDS))

    pp = commands.top.add_parser(
        "partition",
        help="graph partitioning: a model's forward as pipeline stages over slots",
        description=PARTITION_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pp.add_argument("--model", choices=MODEL_NAMES, default="fcn5", help="model to split (default fcn5)")
    pp.add_argument(
        "--stages", type=_positive, default=2, help="stage processes, cut where parameter bytes balance (default 2)"
    )
    pp.add_argument(
        "--cut",
        action="append",
        default=[],
        metavar="NAME",
        help="start a new stage at this module or node (repeatable; overrides --stages)",
    )
    pp.add_argument(
        "--batch",
        type=arg_counts,
        default=[8],
        help="batch size; several (4,8) cycle from step to step and make the edges whose shape "
        "follows the batch dynamic (default 8)",
    )
    pp.add_argument("--steps", type=_positive, default=20, help="forward passes (default 20)")
    pp.add_argument("--warmup", type=arg_nonneg, default=2, help="first steps left out of the timings (default 2)")
    pp.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="data transport between the stages: tcp, shm, rdma, or auto (UCX_TLS as set)",
    )
    pp.add_argument("--image-size", type=int, default=0, help="CNN input size (default: as tensorwire train)")
    pp.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    pp.add_argument("--threads", type=int, default=1, help="torch threads per stage (default 1)")
    pp.add_argument("--timeout", type=float, default=60.0, help="seconds a stage may wait for its inputs")
    pp.add_argument("--plan", action="store_true", help="print the plan and exit")
    pp.add_argument(
        "--train",
        action="store_true",
        help="train instead: activation gradients go back over slots, every stage steps its own "
        "optimizer; checked against the same SGD in one process",
    )
    pp.add_argument(
        "--optimizer",
        choices=("sgd", "adam", "adamw", "adagrad", "rmsprop"),
        default="sgd",
        help="with --train (default sgd)",
    )
    pp.add_argument("--lr", type=float, default=0.01, help="with --train: learning rate (default 0.01)")
    pp.add_argument(
        "--micro-batches",
        type=_positive,
        default=1,
        help="with --train: split every batch into this many (GPipe): the stages work at once "
        "instead of in turns (default 1)",
    )
    pp.add_argument(
        "--no-check", action="store_true", help="skip comparing the outputs with the model run in one process"
    )
    pp.add_argument("--json", metavar="FILE", help="write the result as JSON (stage_stats, edges, samples/s, ...)")
    pp.add_argument(
        "--plot",
        metavar="FILE.png",
        help="plot per stage the mean compute / wait / send per step and the bytes sent, the samples/s "
        "beside one process's and with --train the loss (needs matplotlib)",
    )
    pp.set_defaults(func=run_partition, needs=(("torch", "torch"), PLOT_NEEDS))


def _env_role() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun or mpirun."""
    for r, s in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return None


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like an exception, so the launcher's cleanup kills the roles it spawned."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


PARTITION_HELP = """\
Splits a model's forward into pipeline stages (torch.fx), one process per stage
on this machine, and runs --steps forward passes on synthetic batches. Every
tensor that crosses stages goes over a tensorwire slot: static (pre-allocated,
written in place) when shape propagation finds its shape fixed, dynamic
(metadata, then a read) when it changes with the batch. A stage's output that
crosses stages is produced in registered memory when an nn.Linear or a ReLU
makes it (zero copy), else copied into the pool; the table says which ran.

--train trains instead: the last stage takes the cross-entropy loss, the
gradients of the activations go back over slots of the same kinds, and every
stage steps its own optimizer on its own parameters. One step is in flight, so
the stages take turns unless --micro-batches M splits each batch into M parts
run as GPipe does (every part's forward, then every part's backward, one
optimizer step). The check then compares the parameters and losses with the
same SGD in one process (models with dropout draw other masks there).

Output: the plan (nodes, parameters and edges per stage), per stage the mean
wait / compute / send per step and the sends made zero-copy or copied, then
samples/s of the pipeline beside the same forward in one process (same run), and
the largest difference from that process's outputs. --json writes the result,
--plot draws the per-stage split, the samples/s and, with --train, the loss.

examples:
  tensorwire partition --model fcn5 --stages 2 --plan
  tensorwire partition --model alexnet --cut classifier --transport shm
  tensorwire partition --model mlp --stages 3 --batch 4,8 --transport tcp
  tensorwire partition --model fcn5 --stages 2 --train --lr 0.01 --transport shm
  tensorwire partition --model fcn5 --stages 2 --train --micro-batches 4 --batch 32
  tensorwire partition --model fcn5 --stages 3 --transport tcp --json p.json --plot p.png
"""


def run_partition(args) -> int:
    import time

    import torch

    from ...torch import partition
    from ..paper import data, models

    if args.warmup < 0 or args.warmup >= args.steps:
        print(f"tensorwire partition: error: --warmup must be in 0..{args.steps - 1}", file=sys.stderr)
        return 2
    info = models.get(args.model)
    inputs = data.ModelInputs(args.model, tuple(args.batch), args.seed, args.image_size)
    probe = tuple(range(1, len(args.batch)))
    micro = args.micro_batches if args.train else 1
    if args.micro_batches > 1 and not args.train:
        print("tensorwire partition: error: --micro-batches needs --train", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    try:
        plan = partition.plan(
            info.factory().eval(),
            partition.micro_example(inputs(0), micro),
            args.stages,
            cuts=args.cut or None,
            other_inputs=[partition.micro_example(inputs(i), micro) for i in probe],
        )
    except partition.PartitionError as e:
        print(f"tensorwire partition: error: {e}", file=sys.stderr)
        return 2
    print(plan.describe())
    if args.plan:
        return 0
    common = dict(
        stages=args.stages,
        cuts=args.cut or None,
        steps=args.steps,
        warmup=args.warmup,
        transport=args.transport,
        seed=args.seed,
        probe_steps=probe,
        check=not args.no_check,
        timeout=args.timeout,
        threads=args.threads,
    )
    if args.train:
        data_fn = data.ModelData(args.model, tuple(args.batch), args.seed, args.image_size)
        r = partition.train(
            info.factory, data_fn, optimizer=args.optimizer, lr=args.lr, micro_batches=args.micro_batches, **common
        )
    else:
        r = partition.run(info.factory, inputs, **common)
    # the anchor: the same steps in one process, one thread like a stage
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = info.factory()
    xs = [inputs(i) for i in range(args.steps)]
    if args.train:
        from ...torch import ps

        opt = ps.make_optimizer(args.optimizer, list(model.parameters()), lr=args.lr)
        ys = [data_fn(i)[1] for i in range(args.steps)]

        def one(i: int) -> None:
            loss = torch.nn.functional.cross_entropy(model(*xs[i]), ys[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    else:
        model.eval()

        def one(i: int) -> None:
            with torch.no_grad():
                model(*xs[i])

    for i in range(args.warmup):
        one(i)
    t0 = time.perf_counter()
    for i in range(args.warmup, args.steps):
        one(i)
    local_s = time.perf_counter() - t0
    timed = range(args.warmup, args.steps)
    samples = sum(xs[i][0].shape[0] for i in timed)
    pipe_sps = samples * r.steps_per_s / len(timed)
    local_sps = samples / local_s
    print(
        f"{'stage':>5} {'wait ms':>9} {'compute ms':>11} {'send ms':>9} {'zero-copy':>10} {'copied':>7} {'MiB sent':>9}"
    )
    for st in r.stage_stats:
        n = max(st.steps, 1)
        print(
            f"{st.stage:>5} {1e3 * st.wait_s / n:>9.2f} {1e3 * st.compute_s / n:>11.2f} {1e3 * st.send_s / n:>9.2f} "
            f"{st.sends_zero_copy:>10} {st.sends_copied:>7} {st.bytes_sent / 2**20:>9.1f}"
        )
    print(
        f"pipeline: {pipe_sps:.1f} samples/s over {args.transport} ({r.stages} stages); one process: "
        f"{local_sps:.1f} samples/s ({pipe_sps / local_sps:.2f}x)"
    )
    if r.losses:
        print(f"loss: {r.losses[0]:.4f} at step 0, {r.losses[-1]:.4f} at step {len(r.losses) - 1}")
    if r.max_abs_error is not None:
        what = "parameters and losses" if args.train else "outputs"
        print(f"largest difference from one process ({what}): {r.max_abs_error:.3g}")
    out = r.to_dict()
    out.update(
        {
            "model": args.model,
            "transport": args.transport,
            "batch": args.batch,
            "train": args.train,
            "samples_per_s": pipe_sps,
            "one_process_samples_per_s": local_sps,
            "plan": r.plan,
        }
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        from ..paper.plots import plot_partition

        plot_partition(out, args.plot)
    return 0


def run_train(args) -> int:
    from ...config import export_progress_bar
    from ..paper import models

    _exit_on_sigterm()
    args.progress = export_progress_bar(args.progress)  # resolved once: what every role is told
    if args.list:
        print("Table 1 of the paper (variable tensors, model size in MiB) beside this package's models:")
        print(models.render_table(models.table()))
        return 0
    if (err := device_error(args, "tensorwire train")) is not None:
        print(err, file=sys.stderr)
        return 2
    env = _env_role()
    if env is not None and args.launch == "auto":
        if args.colocate:
            raise SystemExit(
                "tensorwire train: --colocate runs with the local launcher (--launch local); "
                "under torchrun/mpirun every process runs one role"
            )
        from ..paper.launch_env import run_role

        return run_role(args, *env)
    if args.colocate and args.workers != args.servers:
        raise SystemExit(
            f"tensorwire train: --colocate runs worker r and server r in process r: needs --servers "
            f"equal to --workers (got {args.servers} servers, {args.workers} workers)"
        )
    r = train_once(args, progress=args.progress)
    print(render_result(r, args))
    out = r.to_dict()
    out.update(model=args.model, batch=args.batch, transport=args.transport if r.mode != "gloo" else "tcp")
    if args.target_loss is not None:
        hit = time_to_target(r.losses, mean_step_times(r), args.target_loss)
        out["target_loss"] = args.target_loss
        out["time_to_target_s"] = None if hit is None else hit[1]
        out["steps_to_target"] = None if hit is None else hit[0]
        print(
            f"target loss {args.target_loss}: "
            + ("not reached" if hit is None else f"step {hit[0]}, {hit[1]:.2f} s of training steps")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        from ..paper.plots import plot_run

        plot_run(r, args, args.plot)
    return 0


def run_bench(args) -> int:
    _exit_on_sigterm()
    from ..paper.bench_train import run_sweep

    return run_sweep(args)
