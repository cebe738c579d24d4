"""The parameter server on a GPU (issue 20 §5): with --device cuda the PS must
still equal single-process SGD, with GPUDirect (GPU memory registered and moved
as is) and without (every tensor staged through host memory). The GPU tests
are marked ``gpu`` and skipped without CUDA; the rest run anywhere: the usage
errors (exit 2), --help, the GDR-off staging path run on the CPU, and the CPU
path with the new options at their defaults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from tensorwire.torch import ps  # noqa: E402

pytestmark = pytest.mark.torch

STEPS = 5
HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
# the CLI's default; with a GPU the core adds UCX's cuda_copy and cuda_ipc to shared memory
GPU_TRANSPORT = "shm"

# the CPU tests' models and data (one definition; spawned processes import them from there)
from conftest import cli_in_process  # noqa: E402
from test_torch_ps import mlp_data, small_mlp, small_wide_deep, wide_deep_data  # noqa: E402


def _assert_same(model: torch.nn.Module, params: dict, atol: float) -> None:
    for name, p in model.named_parameters():
        diff = (p.detach().cpu() - params[name].cpu()).abs().max().item()
        assert diff <= atol, f"{name}: max difference {diff}"


def _staged_bytes(model_fn, workers: int) -> int:
    """What GDR off copies between GPU and host per step, all processes (dense models):
    each worker its gradients out and parameters in, the servers every worker's
    gradients in and the parameters out once."""
    n = sum(p.numel() * p.element_size() for p in model_fn().parameters())
    return workers * 2 * n + (workers + 1) * n


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorwire", *args], capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("gdr", [True, False], ids=["gdr-on", "gdr-off"])
def test_gpu_dense_matches_single_process_sgd(gdr):
    """Mirrors test_torch_ps's CPU test: 2 workers x 2 servers in processes, 5 steps."""
    r = ps.train(
        small_mlp,
        mlp_data,
        workers=2,
        servers=2,
        steps=STEPS,
        mode="zerocopy",
        transport=GPU_TRANSPORT,
        lr=0.3,
        momentum=0.5,
        warmup=0,
        collect_params=True,
        timeout=60,
        device="cuda",
        gdr=gdr,
    )
    ref, ref_losses = ps.reference_sgd(small_mlp, mlp_data, workers=2, steps=STEPS, lr=0.3, momentum=0.5, device="cuda")
    _assert_same(ref, r.params, atol=1e-4)
    assert r.losses == pytest.approx(ref_losses, abs=1e-4)
    assert r.device == "cuda" and r.gdr is gdr
    assert r.bytes_copied_per_step == 0
    assert r.bytes_staged_per_step == (0 if gdr else _staged_bytes(small_mlp, 2))
    assert all(ro.get("device") == f"cuda (GDR {'on' if gdr else 'off'})" for ro in r.roles)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["zerocopy", "copy"])
def test_gpu_gdr_off_gives_the_same_result(mode):
    """GDR on and off train the same parameters (roles as threads: one CUDA context)."""
    runs = {
        gdr: ps.train(
            small_mlp,
            mlp_data,
            workers=2,
            servers=2,
            steps=STEPS,
            mode=mode,
            transport=GPU_TRANSPORT,
            lr=0.3,
            warmup=0,
            collect_params=True,
            timeout=60,
            launcher="threads",
            device="cuda",
            gdr=gdr,
        )
        for gdr in (True, False)
    }
    ref, _ = ps.reference_sgd(small_mlp, mlp_data, workers=2, steps=STEPS, lr=0.3, device="cuda")
    for r in runs.values():
        _assert_same(ref, r.params, atol=1e-4)
    on, off = runs[True].params, runs[False].params
    for name in on:
        assert (on[name] - off[name]).abs().max().item() <= 1e-5, name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("gdr", [True, False], ids=["gdr-on", "gdr-off"])
def test_gpu_sparse_gradients_match_single_process_sgd(gdr):
    """Sparse embedding gradients through dynamic slots in GPU memory (GDR on) or host memory."""
    r = ps.train(
        small_wide_deep,
        wide_deep_data,
        workers=2,
        servers=2,
        steps=STEPS,
        mode="zerocopy",
        transport=GPU_TRANSPORT,
        lr=0.5,
        warmup=0,
        collect_params=True,
        timeout=60,
        launcher="threads",
        device="cuda",
        gdr=gdr,
    )
    ref, _ = ps.reference_sgd(small_wide_deep, wide_deep_data, workers=2, steps=STEPS, lr=0.5, device="cuda")
    _assert_same(ref, r.params, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
def test_gpu_cli_train_and_table2(tmp_path):
    for gdr in ("on", "off"):
        out = tmp_path / f"r_{gdr}.json"
        p = _run(
            [
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
                "--device",
                "cuda",
                "--gdr",
                gdr,
                "--transport",
                GPU_TRANSPORT,
                "--json",
                str(out),
            ]
        )
        assert p.returncode == 0, p.stderr
        d = json.loads(out.read_text())
        assert d["device"] == "cuda" and d["gdr"] is (gdr == "on") and d["samples_per_s"] > 0
        assert f"(GDR {gdr})" in p.stdout
    out = tmp_path / "t2.json"
    p = _run(
        [
            "bench",
            "train",
            "--figures",
            "table2",
            "--models",
            "mlp",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--transport",
            GPU_TRANSPORT,
            "--json",
            str(out),
        ],
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert sorted(r["gdr"] for r in d["table2"]) == ["off", "on"]
    assert all(r["step_ms"] > 0 for r in d["table2"]), d["table2"]
    assert "Table 2" in p.stdout


# --------------------------------------------------------------------- anywhere


@pytest.mark.skipif(HAS_GPU, reason="checks the message of a machine without a GPU")
@pytest.mark.parametrize(
    "args",
    [
        ["train", "--device", "cuda", "--steps", "1"],
        ["train", "--device", "cuda", "--gdr", "off", "--steps", "1"],
        ["bench", "train", "--figures", "table2"],
        ["bench", "train", "--figures", "fig8,table2", "--models", "mlp"],
    ],
)
def test_without_a_gpu_cuda_exits_2_saying_why(args, tmp_path, capsys):
    p = cli_in_process(args + (["--json", str(tmp_path / "x.json")] if args[0] == "bench" else []), capsys)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "needs a CUDA GPU: torch.cuda.is_available() is False" in p.stderr
    assert "Traceback" not in p.stderr and not list(tmp_path.iterdir())  # nothing ran, nothing written


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--gdr", "off"], "--gdr selects how GPU memory moves: it needs --device cuda"),
        (["train", "--device", "cuda", "--mode", "gloo"], "--mode gloo runs on the CPU"),
        (["train", "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
    ],
)
def test_device_usage_errors_exit_2(args, message, capsys):
    p = cli_in_process(args + ["--steps", "1"], capsys)
    assert p.returncode == 2 and message in p.stderr, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr


def test_help_mentions_device_and_gdr(capsys):
    for cmd in (["train"], ["bench", "train"]):
        h = cli_in_process(cmd + ["--help"], capsys)
        assert h.returncode == 0
        assert "--device" in h.stdout and "--gdr" in h.stdout, cmd
        assert cmd[0] != "bench" or "table2" in h.stdout, h.stdout


def test_train_api_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="gloo runs on the CPU"):
        ps.train(small_mlp, mlp_data, workers=1, servers=1, steps=1, mode="gloo", device="cuda")
    with pytest.raises(ValueError, match="needs device cuda"):
        ps.train(small_mlp, mlp_data, workers=1, servers=1, steps=1, gdr=True)
    if not HAS_GPU:
        with pytest.raises(ps.PSError, match="needs a CUDA GPU"):
            ps.train(small_mlp, mlp_data, workers=1, servers=1, steps=1, device="cuda")


def test_memory_kinds():
    """Which memory moves: GDR on moves GPU memory; off (and the CPU) host memory. Touches no GPU."""
    cpu, on, off, n = ps.Memory("cpu"), ps.Memory("cuda"), ps.Memory("cuda", gdr=False), ps.Memory("cuda:1")
    assert (cpu.kind, cpu.staged, cpu.defer, cpu.gdr) == ("host", False, False, None)
    assert (on.kind, on.staged, on.defer, on.gdr) == ("cuda", False, True, True)
    assert (off.kind, off.staged, off.defer, off.gdr) == ("host", True, False, False)
    assert n.kind == "cuda:1" and off.label == "cuda (GDR off)" and on.label == "cuda (GDR on)"


@pytest.mark.parametrize(
    "model_fn,data_fn,launcher", [(small_mlp, mlp_data, "processes"), (small_wide_deep, wide_deep_data, "threads")]
)
def test_gdr_off_staging_path_on_the_cpu(model_fn, data_fn, launcher):
    """gdr=False on the CPU runs GDR off's code path (compute tensors apart from
    the host blocks that move, copies both ways): it must still equal SGD."""
    r = ps.train(
        model_fn,
        data_fn,
        workers=2,
        servers=2,
        steps=STEPS,
        mode="zerocopy",
        transport="tcp",
        lr=0.3,
        warmup=0,
        collect_params=True,
        timeout=60,
        launcher=launcher,
        gdr=False,
    )
    ref, ref_losses = ps.reference_sgd(model_fn, data_fn, workers=2, steps=STEPS, lr=0.3)
    _assert_same(ref, r.params, atol=1e-5)
    assert r.losses == pytest.approx(ref_losses, abs=1e-5)
    assert r.bytes_copied_per_step == 0 and r.bytes_staged_per_step > 0
    if model_fn is small_mlp:
        assert r.bytes_staged_per_step == _staged_bytes(small_mlp, 2)


def test_cpu_path_unchanged_by_the_new_options(tmp_path):
    """--device cpu (the default) is the PS as before: nothing staged, no GDR."""
    out = tmp_path / "r.json"
    p = _run(
        [
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
            "--no-progress",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["device"] == "cpu" and d["gdr"] is None and d["bytes_staged_per_step"] == 0
    assert "GDR" not in p.stdout and "staged" not in p.stdout
    r = ps.train(
        small_mlp,
        mlp_data,
        workers=2,
        servers=1,
        steps=STEPS,
        mode="copy",
        transport="tcp",
        lr=0.3,
        warmup=0,
        collect_params=True,
        timeout=60,
        launcher="threads",
    )
    ref, _ = ps.reference_sgd(small_mlp, mlp_data, workers=2, steps=STEPS, lr=0.3)
    _assert_same(ref, r.params, atol=1e-5)
    assert (r.device, r.gdr, r.bytes_staged_per_step) == ("cpu", None, 0)
