"""Parameter-server training (tensorwire.torch.ps): synchronous SGD over slots
must equal single-process SGD on the concatenated batches; sparse gradients go
through dynamic slots; a dead worker fails everyone fast; a differing model is
refused at setup naming the variable. Plus the models' Table 1 numbers and the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from conftest import cli_in_process  # noqa: E402
from tensorwire.lab.paper import data, models  # noqa: E402
from tensorwire.torch import ps  # noqa: E402

pytestmark = pytest.mark.torch

STEPS = 5


def small_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def mlp_data(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 12, generator=g), torch.randint(0, 5, (6,), generator=g)


def small_wide_deep() -> torch.nn.Module:
    return models.WideAndDeep(fields=3, vocab=50, dim=4, dense_features=3, hidden=8)


def wide_deep_data(rank: int, step: int):
    return data.wide_deep_batch(8, rank, step, seed=3, fields=3, vocab=50, dense_features=3)


def mismatched_mlp(rank: int) -> torch.nn.Module:
    hidden = 16 if rank == 0 else 17
    return torch.nn.Sequential(torch.nn.Linear(12, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 5))


def _assert_same(model: torch.nn.Module, params: dict, atol: float = 1e-5) -> None:
    for name, p in model.named_parameters():
        assert name in params
        diff = (p.detach() - params[name]).abs().max().item()
        assert diff <= atol, f"{name}: max difference {diff}"


# Roles run as spawned processes (the default launcher) where the process
# boundary matters; elsewhere as threads of this process, each with its own
# device and slots (same code path, seconds instead of tens of seconds).
@pytest.mark.parametrize("mode,launcher", [("zerocopy", "processes"), ("copy", "threads")])
def test_dense_matches_single_process_sgd(mode, launcher):
    r = ps.train(
        small_mlp,
        mlp_data,
        workers=2,
        servers=2,
        steps=STEPS,
        mode=mode,
        transport="shm",
        lr=0.3,
        momentum=0.5,
        warmup=0,
        collect_params=True,
        timeout=60,
        launcher=launcher,
    )
    ref, ref_losses = ps.reference_sgd(small_mlp, mlp_data, workers=2, steps=STEPS, lr=0.3, momentum=0.5)
    _assert_same(ref, r.params)
    assert r.losses == pytest.approx(ref_losses, abs=1e-5)
    per_var = sum(p.numel() * 4 for p in small_mlp().parameters())
    if mode == "zerocopy":
        assert r.bytes_copied_per_step == 0
    else:  # gradients on the 2 workers, parameters to 2 workers on the servers
        assert r.bytes_copied_per_step == 2 * per_var + 2 * per_var
    assert r.bytes_sent_per_step == 4 * per_var
    assert r.samples_per_s > 0 and set(r.split) >= {"compute", "push", "aggregate", "pull"}


def test_gloo_matches_single_process_sgd():
    """The baseline runs the same algorithm: wide-and-deep has dense and sparse variables."""
    r = ps.train(
        small_wide_deep,
        wide_deep_data,
        workers=2,
        servers=2,
        steps=STEPS,
        mode="gloo",
        lr=0.5,
        warmup=0,
        collect_params=True,
        timeout=60,
    )
    ref, _ = ps.reference_sgd(small_wide_deep, wide_deep_data, workers=2, steps=STEPS, lr=0.5)
    _assert_same(ref, r.params)


@pytest.mark.parametrize("mode", ["zerocopy", "copy"])
def test_sparse_gradients_match_single_process_sgd(mode):
    model = small_wide_deep()
    sparse = [v.name for v, _ in ps.variables(model) if v.sparse]
    assert sparse == ["wide.weight", "embed.weight"]
    r = ps.train(
        small_wide_deep,
        wide_deep_data,
        workers=2,
        servers=2,
        steps=STEPS,
        mode=mode,
        transport="tcp",
        lr=0.5,
        warmup=0,
        collect_params=True,
        timeout=60,
        launcher="threads",
    )
    ref, _ = ps.reference_sgd(small_wide_deep, wide_deep_data, workers=2, steps=STEPS, lr=0.5)
    _assert_same(ref, r.params)


def test_dead_worker_fails_everyone_fast():
    """Worker 1 exits at step 3: the servers and worker 0 must fail on their own,
    naming it, within the launcher's 10 s grace (or it would have killed them)."""
    t0 = time.monotonic()
    with pytest.raises(ps.PSError) as err:
        ps.train(
            small_mlp,
            mlp_data,
            workers=2,
            servers=2,
            steps=40,
            mode="zerocopy",
            transport="shm",
            die=(1, 3),
            timeout=60,
        )
    msg = str(err.value)
    # the servers saw worker 1 go and said so; nobody had to be killed by the launcher
    lines = {ln.split(":")[0].strip(): ln for ln in msg.splitlines()[1:]}
    for s in ("server 0", "server 1"):
        assert s in lines and "worker 1" in lines[s] and "died or disconnected" in lines[s], msg
    assert "killed by the launcher" not in msg, msg
    assert "worker 0:" in msg, msg
    assert time.monotonic() - t0 < 120  # includes start-up


@pytest.mark.parametrize("mode,transport", [("zerocopy", "tcp"), ("copy", "shm"), ("gloo", "tcp")])
def test_colocated_matches_single_process_sgd(mode, transport):
    """The paper's layout: process r runs worker r and server r (wide-and-deep:
    dense and sparse variables). What a worker exchanges with its own server
    stays in the process: of a step's pulls (every variable) and dense pushes,
    only the other worker's cross the transport, half the separate layout's."""
    r = ps.train(
        small_wide_deep,
        wide_deep_data,
        workers=2,
        servers=2,
        steps=STEPS,
        mode=mode,
        transport=transport,
        lr=0.5,
        warmup=0,
        collect_params=True,
        timeout=60,
        colocate=True,
    )
    ref, ref_losses = ps.reference_sgd(small_wide_deep, wide_deep_data, workers=2, steps=STEPS, lr=0.5)
    _assert_same(ref, r.params)
    assert r.losses == pytest.approx(ref_losses, abs=1e-5)
    assert r.colocate and len(r.worker_losses) == 2
    specs = [v for v, _ in ps.variables(small_wide_deep())]
    every, dense = sum(v.nbytes for v in specs), sum(v.nbytes for v in specs if not v.sparse)
    assert r.bytes_sent_per_step == every + dense


def test_colocate_needs_a_server_per_worker():
    with pytest.raises(ValueError, match="servers == workers"):
        ps.train(small_mlp, mlp_data, workers=2, servers=1, steps=2, colocate=True)


def test_colocated_dead_worker_fails_everyone_fast():
    """Process 1 (worker 1 and server 1) dies at step 3: process 0 must fail on
    its own, naming the dead peer, before the launcher's grace runs out."""
    t0 = time.monotonic()
    with pytest.raises(ps.PSError) as err:
        ps.train(
            small_mlp,
            mlp_data,
            workers=2,
            servers=2,
            steps=40,
            mode="zerocopy",
            transport="tcp",
            die=(1, 3),
            timeout=60,
            colocate=True,
        )
    msg = str(err.value)
    lines = {ln.split(":")[0].strip(): ln for ln in msg.splitlines()[1:]}
    # it names what it was doing and the peer that went (by role, or by address and pid)
    assert "worker and server 0" in lines, msg
    assert re.search(r"(worker|server) 1 |peer \S+ \(pid \d+\)", lines["worker and server 0"]), msg
    assert "killed by the launcher" not in msg, msg
    assert time.monotonic() - t0 < 60  # includes start-up


def test_mismatched_model_refused_naming_the_variable():
    with pytest.raises(ps.PSError) as err:
        ps.train(
            mismatched_mlp,
            mlp_data,
            workers=2,
            servers=1,
            steps=3,
            mode="zerocopy",
            transport="tcp",
            timeout=30,
            launcher="threads",
        )
    msg = str(err.value)
    assert "refused at setup" in msg and "'0.weight'" in msg and "worker 1" in msg, msg
    assert "float32[17, 12] vs float32[16, 12]" in msg, msg


def test_check_specs_messages():
    a = [ps.VarSpec("w", (3, 4), "float32", False), ps.VarSpec("b", (4,), "float32", False)]
    assert ps.check_specs(a, a, 1) is None
    assert "'b'" in ps.check_specs(a, a[:1], 2)
    assert "'w'" in ps.check_specs(a, [ps.VarSpec("w", (3, 5), "float32", False), a[1]], 1)
    assert "'x'" in ps.check_specs(a, [ps.VarSpec("x", (3, 4), "float32", False), a[1]], 1)
    assert "orders" in ps.check_specs(a, a[::-1], 1)


def test_placement_round_robin_and_balanced():
    # FCN-5-like: weights and biases alternate, so round-robin over 2 servers
    # puts every weight on server 0; balanced splits the bytes.
    sizes = [64 << 20, 16 << 10, 64 << 20, 16 << 10, 64 << 20, 16 << 10, 40 << 10, 40]
    assert ps.place(sizes, 2, "round-robin") == [0, 1, 0, 1, 0, 1, 0, 1]
    owner = ps.place(sizes, 2)
    load = [sum(n for n, o in zip(sizes, owner) if o == s) for s in range(2)]
    assert max(load) - min(load) <= 64 << 20 and min(load) >= 64 << 20, load
    assert ps.place(sizes, 3) == ps.place(sizes, 3, "balanced")  # deterministic: every role computes it
    assert sorted(set(ps.place(sizes, 3))) == [0, 1, 2]
    assert ps.place([5, 5, 5, 5], 2) == [0, 1, 0, 1]  # ties: model order, lowest server
    with pytest.raises(ValueError, match="placement must be one of"):
        ps.place(sizes, 2, "random")
    with pytest.raises(ValueError, match="placement must be one of"):
        ps.train(small_mlp, mlp_data, workers=1, servers=1, steps=1, placement="greedy")


def test_worker_with_another_placement_is_refused():
    import threading

    server = ps.Server(
        rank=0, num_servers=1, num_workers=1, transport="tcp", timeout=5, placement="round-robin", lr=0.1
    )
    t = threading.Thread(target=lambda: pytest.raises(ps.PSError, server.run), daemon=True)
    t.start()
    try:
        with pytest.raises(ps.PSError, match="places variables 'round-robin', worker 0 'balanced'"):
            ps.Worker(
                small_mlp(), [server.address], rank=0, num_workers=1, transport="tcp", timeout=5, placement="balanced"
            )
    finally:
        t.join(15)
    assert not t.is_alive()


def test_models_match_table1():
    rows = {r["model"]: r for r in models.table()}
    for name in models.PAPER_MODELS:
        r = rows[name]
        assert r["vars"] == r["paper_vars"], name
        assert r["MiB"] == pytest.approx(r["paper_MiB"], abs=0.01), name


@pytest.mark.parametrize("name", ["alexnet", "inception3", "lstm", "gru", "widedeep"])
def test_models_forward_backward(name):
    torch.manual_seed(0)
    model = models.get(name).factory()
    x, y = data.Synthetic(name, 2, seq_len=3)(0, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cli_list_and_help(capsys):
    out = cli_in_process(["train", "--list"], capsys)
    assert out.returncode == 0, out.stderr
    assert "176.42" in out.stdout and "vgg16" in out.stdout
    h = cli_in_process(["train", "--help"], capsys)
    assert h.returncode == 0 and "zerocopy" in h.stdout and "--transport" in h.stdout


def test_cli_train_json(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "train",
            "--model",
            "mlp",
            "--workers",
            "1",
            "--servers",
            "1",
            "--batch",
            "4",
            "--steps",
            "4",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    import json

    d = json.loads(out.read_text())
    assert d["samples_per_s"] > 0 and {"compute", "push", "aggregate", "pull"} <= set(d["split"])
    assert "samples/s" in p.stdout


def test_cli_train_under_torchrun_meets_in_its_store():
    """Under torchrun (its agent's TCPStore at MASTER_ADDR:MASTER_PORT) every process
    runs one role; the server's address meets the worker in that store, under the
    keys of the local launch."""
    import datetime
    import json
    import os

    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update(
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_RUN_ID="t",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    cmd = [
        sys.executable,
        "-m",
        "tensorwire",
        "train",
        "--model",
        "mlp",
        "--workers",
        "1",
        "--servers",
        "1",
        "--batch",
        "4",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--no-progress",
        "--transport",
        "tcp",
    ]
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    server, worker = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert server["role"] == "server" and worker["role"] == "worker" and worker["samples_per_s"] > 0
    assert store.get("tensorwire/ps/t/0/server/0").decode().startswith("127.0.0.1:")


def test_cli_colocate(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "tensorwire", "train", "--workers", "2", "--servers", "1", "--colocate", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "needs --servers equal to --workers" in bad.stderr
    assert "Traceback" not in bad.stderr
    out = tmp_path / "r.json"
    # one process holds the only worker and the only server: nothing crosses the transport
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "train",
            "--model",
            "mlp",
            "--workers",
            "1",
            "--servers",
            "1",
            "--batch",
            "4",
            "--steps",
            "4",
            "--no-progress",
            "--colocate",
            "--transport",
            "tcp",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    import json

    d = json.loads(out.read_text())
    assert d["colocate"] is True and d["bytes_sent_per_step"] == 0 and d["samples_per_s"] > 0
    assert "(colocated)" in p.stdout


def test_a_worker_that_finishes_first_and_leaves_is_no_failure():
    """Worker 0 finishes and closes its device while worker 1 still takes its
    time before leaving: the servers wait for worker 1's goodbye (they used to
    take worker 0's closed device for a death and fail the run)."""
    import threading

    servers = [ps.Server(rank=s, num_servers=2, num_workers=2, transport="tcp", timeout=30, lr=0.1) for s in range(2)]
    errors: list[str] = []
    lanes: dict[int, list[int]] = {}

    def serve(srv):
        try:
            srv.run()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"server {srv.rank}: {e}")

    def work(rank: int, linger: float):
        torch.manual_seed(0)
        model = small_mlp()
        w = ps.Worker(model, [s.address for s in servers], rank=rank, num_workers=2, transport="tcp", timeout=30)
        lanes[rank] = [ch.lane for ch in w.channels]
        try:
            for step in range(3):
                x, y = mlp_data(rank, step)
                w.step(lambda: torch.nn.functional.cross_entropy(model(x), y))
            time.sleep(linger)  # worker 0's device is gone by now: its slots raise at the servers
        except Exception as e:  # noqa: BLE001
            errors.append(f"worker {rank}: {e}")
        finally:
            w.close()

    threads = [threading.Thread(target=serve, args=(s,)) for s in servers]
    threads += [threading.Thread(target=work, args=(0, 0.0)), threading.Thread(target=work, args=(1, 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert all(s.steps_done == 3 for s in servers)
    # the server lanes: worker r's channels to and from every server are lane r, and
    # a server has a UCX worker per worker process (up to the cores)
    assert lanes == {0: [0, 0], 1: [1, 1]}
    assert all([ch.lane for ch in s.channels] == [0, 1] for s in servers)
    assert all(s.dev.workers == min(2, os.cpu_count() or 1) for s in servers)


def test_server_lanes_one_per_worker_up_to_the_cores():
    from tensorwire.torch.ps.common import server_lanes

    cores = os.cpu_count() or 1
    assert server_lanes(1) == 1
    assert server_lanes(0) == 1
    assert server_lanes(2) == min(2, cores)
    assert server_lanes(10 * cores) == cores


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bench_train_smoke_with_the_floor(tmp_path, transport):
    """`tensorwire bench train`: Figure 8 for every mode, the targets, and the
    transport's floor anchor beside them, in the table (stdout) and the JSON;
    --plot draws the PNG, and nothing else is written. One worker (a server and
    a worker per mode), and over tcp one mode (--modes), as make test's time goes:
    the floor is what differs."""
    import importlib.util
    import json

    plot = ["--plot", "bt.png"] if importlib.util.find_spec("matplotlib") and transport == "shm" else []
    few = ["--modes", "zerocopy"] if transport == "tcp" else []
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "bench",
            "train",
            "--transport",
            transport,
            "--models",
            "mlp",
            "--batches",
            "2",
            "--figures",
            "fig8",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--json",
            "bt.json",
            "--workers",
            "1",
            *few,
            *plot,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    floor_name = {"tcp": "TCP floor", "shm": "shm floor"}[transport]
    assert "Figure 8" in p.stdout and floor_name in p.stdout, p.stdout
    row = r"^mlp +2 +\d+\.\d\d$" if few else r"^mlp +2( +\d+\.\d\d){3}( +\d+\.\d\dx){2}$"
    assert re.search(row, p.stdout, re.M), p.stdout  # Figure 8's row
    assert ("gloo %" in p.stdout) == (not few), p.stdout  # the floor table's gloo column only where gloo ran
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(["bt.json"] + plot[1:])
    if plot:
        assert (tmp_path / "bt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads((tmp_path / "bt.json").read_text())
    assert sorted(r["mode"] for r in d["fig8"]) == (["zerocopy"] if few else ["copy", "gloo", "zerocopy"])
    assert all(r["samples_per_s"] > 0 for r in d["fig8"])
    if not few:
        assert f"targets ({transport}" in p.stdout
    (floor,) = d["floor"]
    assert floor["model"] == "mlp" and floor["batch"] == 2 and floor["sequential"] > 0
    assert floor["transport"] == transport


def test_bench_train_plot_has_a_panel_per_figure(tmp_path):
    """--plot draws every figure that ran into one PNG (made-up results of all five)."""
    pytest.importorskip("matplotlib")
    from tensorwire.cli import build_parser
    from tensorwire.lab.paper.plots import SWEEP_PANELS, plot_sweep

    args = build_parser().parse_args(["bench", "train", "--models", "fcn5,alexnet", "--batches", "1,8"])

    def run(model, batch, mode, n=2, **kw):
        sps = {"zerocopy": 30.0, "copy": 20.0, "gloo": 10.0, "local": 40.0}[mode] * batch
        return {
            "model": model,
            "batch": batch,
            "mode": mode,
            "workers": n,
            "samples_per_s": sps,
            "step_ms": 1e3 * batch / sps,
            **kw,
        }

    modes = ("zerocopy", "copy", "gloo")
    losses = [2.3 * 0.98**i for i in range(50)]
    out = {
        "fig8": [run(m, b, mode) for m in args.models for b in args.batches for mode in modes],
        "fig10": [run("fcn5", 8, "local", 1)] + [run("fcn5", 8, mode, n) for n in (1, 2) for mode in modes[::2]],
        "fig11": [run(m, 8, mode) for m in args.models for mode in modes[:2]],
        "convergence": [{"run": r, "losses": losses} for r in ("single process", "2x2 copy")],
        "table2": [run(m, 8, "zerocopy", gdr=gdr) for m in ("fcn5", "alexnet") for gdr in ("off", "on")],
    }
    assert [name for name, _ in SWEEP_PANELS] == list(out)
    png = tmp_path / "sweep.png"
    plot_sweep(out, args, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > height  # 3 panels in a row, 2 rows
    only = tmp_path / "fig8.png"
    plot_sweep({"fig8": out["fig8"], "fig10": [], "convergence": None}, args, str(only))
    assert matplotlib.image.imread(only).shape[1] < width  # one panel


def test_bench_train_repeats_go_round_the_modes(monkeypatch):
    """--repeat N runs a configuration's modes in turn (a, b, a, b, ...), keeps
    each mode's best, and a mode that fails once is not run again."""
    import types

    from tensorwire.cli import build_parser
    from tensorwire.lab.paper import bench_train

    args = build_parser().parse_args(["bench", "train", "--repeat", "3"])
    order, speed = [], iter([5.0, 1.0, 7.0, 4.0, 2.0, 3.0])  # zerocopy, gloo, zerocopy, ...: the copy runs fail

    def fake_train_once(args, *, model, batch, mode, workers, servers, **over):
        order.append(mode)
        if mode == "copy":
            raise RuntimeError("copy broke")
        split = {"step": 0.1, "compute": 0.0, "push": 0.0, "aggregate": 0.0, "pull": 0.0}
        return types.SimpleNamespace(
            samples_per_s=next(speed),
            split=split,
            bytes_copied_per_step=0,
            bytes_sent_per_step=0,
            bytes_staged_per_step=0,
            device="cpu",
        )

    monkeypatch.setattr(bench_train, "train_once", fake_train_once)
    rows = bench_train._runs(args, "mlp", 2, 2, [("zerocopy", {}), ("copy", {}), ("gloo", {})])
    assert order == ["zerocopy", "copy", "gloo", "zerocopy", "gloo", "zerocopy", "gloo"]
    assert [r["mode"] for r in rows] == ["zerocopy", "copy", "gloo"]
    assert rows[0]["samples_per_s"] == 7.0 and rows[2]["samples_per_s"] == 4.0  # the best of each, not the last
    assert rows[1]["error"] == "copy broke"


def test_bench_train_says_when_the_target_is_above_the_floor():
    """The floor table names the (model, batch) whose target (2x gloo over shm)
    exceeds both bounds, and only those (made-up results)."""
    from tensorwire.cli import build_parser
    from tensorwire.lab.paper.bench_train import render_rest

    args = build_parser().parse_args(["bench", "train", "--transport", "shm", "--models", "fcn5", "--batches", "1,8"])
    gloo = {1: 10.0, 8: 60.0}  # 2x: 20 (under the bounds below) and 120 (above both)
    fig8 = [
        {"model": "fcn5", "batch": b, "mode": m, "samples_per_s": {"zerocopy": 1.9, "gloo": 1.0}[m] * gloo[b]}
        for b in (1, 8)
        for m in ("zerocopy", "gloo")
    ]
    floor = [
        {
            "model": "fcn5",
            "batch": b,
            "mib_per_step": 818.0,
            "floor_ms": 40.0,
            "aggregate_ms": 15.0,
            "sequential": seq,
            "overlapped": ovl,
        }
        for b, seq, ovl in ((1, 24.0, 26.0), (8, 110.0, 115.0))
    ]
    text = render_rest(
        {
            "fig8": fig8,
            "floor": floor,
            "fig10": [],
            "fig11": [],
            "convergence": None,
            "table2": [],
            "elapsed_s": 1.0,
            "host": {"loadavg_end": (0.5, 0.5, 0.5)},
        },
        args,
        [],
    )
    assert "shm floor" in text
    (note,) = [line for line in text.splitlines() if "above both bounds" in line]
    assert "fcn5 batch 8" in note and "batch 1" not in note


def test_a_push_to_a_dead_server_names_it():
    """A send whose peer is gone, failing when posted or when awaited, is a
    PSError naming that peer (the watch's description), not a bare error."""
    import numpy as np

    import tensorwire as tw
    from tensorwire.torch.ps.common import Watch

    server, worker = tw.Device(transport="shm"), tw.Device(transport="shm")
    try:
        slot = server.static_slot("grad", (256,), "float32", depth=1)  # noqa: F841 (kept alive)
        ch = worker.connect(server.address)
        sender = ch.static_sender("grad")
        watch = Watch(worker, 10.0, "worker 0")
        watch.peers[server.id] = "server 0 (test)"
        g = np.ones(256, np.float32)
        watch.wait(watch.send(sender, g, "pushing 'w'"), "pushing 'w'")
        server.close()
        deadline = time.monotonic() + 10
        while any(p["device_id"] == server.id for p in worker.peers()) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ps.PSError, match=r"worker 0: server 0 \(test\) died or disconnected while pushing 'w'"):
            watch.wait(watch.send(sender, g, "pushing 'w'"), "pushing 'w'")
    finally:
        worker.close()
        server.close()
