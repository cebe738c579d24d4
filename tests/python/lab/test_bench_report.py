"""`tensorwire bench report` (issue 36 §2): --dry-run lists the benchmark commands behind the
README's numbers, --only selects steps, a step's files land in bench/results/ (a failed one
keeps the old file), and the README's blocks are regenerated from given result files. No
benchmark runs here."""

from __future__ import annotations

import pathlib
import sys

import pytest

from tensorwire import cli
from tensorwire.lab.fabric import report

ROOT = pathlib.Path(__file__).resolve().parents[3]

# Excerpts of each file in the format its command writes.
FILES = {
    "compare_ucx_perftest.txt": """\
# command: bench/compare_ucx_perftest.sh --reps 3
# date: 2026-11-21T14:28:20Z host: vm cpus: 2
# tensorwire vs anchors, UCX 1.22.0 (libucp.so.0), median of 3 runs
tr   metric        bytes  tensorwire anchor                             anchor unit    ratio
tcp  bw          1048576     6663.59 ucx_perftest ucp_put_bw           4485.32 MB/s    1.49x  (target >= 0.90x) PASS
shm  lat               8        0.09 ucx_perftest ucp_put_lat             0.08 us      0.88x  (target >= 0.77x) PASS
PASS compare_ucx_perftest 2/2 ratios meet their targets
""",
    "tensor_shm.txt": """\
# command: tensorwire bench tensor --transport shm --repeat 3 --json bench/results/tensor_shm.json
# date: 2026-11-22 03:41-03:46 UTC (quiet machine: this session only) host: vm cpus: 2, code 51bfc75
# Tensor transfer + consume over shm (float32; median per transfer; best of 3 interleaved passes)
#   PASS zerocopy >= 10x grpc                        13.48x (bar 10x) worst at 8M of 9 size(s)
#   MISS zerocopy >= ucx-tag                          0.74x (bar 1x) worst at 8M of 19 size(s)
#   PASS zerocopy transfer >= 0.9x memcpy             1.71x (bar 0.9x) worst at 256M of 1 size(s)
PASS tensor shm zerocopy=11638.3MB/s@256M speed-up: dynamic 0.98x, copy 1.79x, grpc 32.93x
""",
    "torch_dist_shm.txt": """\
# tensorwire bench torch-dist --transport shm --no-progress --json bench/results/torch_dist_shm.json
# 2026-11-28 at e98b2b2+; 2 ranks
---------------------------------------------------------------------------------------
    # Size    tw Lat (us)  gloo Lat (us)    ratio
         8          15.09          47.12    3.12x
---------------------------------------------------------------------------------------
# all_reduce, 2 ranks: Avg Latency(us)
---------------------------------------------------------------------------------------
    # Size     tensorwire           gloo    ratio
   1048576         225.78        1349.32    5.98x
  16777216        2623.40       11027.92    4.20x
---------------------------------------------------------------------------------------
# target send/recv 8 B latency <= 1/5 of gloo's: 3.12x MISS
# target all_reduce 1M >= 2x gloo: 5.98x PASS
MISS: 1 of 2 targets (send/recv 8 B latency <= 1/5 of gloo's)
""",
    "net_tcp_train_b1.txt": """\
# command: tensorwire bench train --transport tcp --figures fig8 --batches 1 --steps 20 --repeat 2   (2026-11-27, code 5ede37a)
tensorwire bench train: transport tcp (gloo: tcp), 20 steps per run (2 warm-up), best of 2

Figure 8: samples/s, 2 workers x 2 servers
model       batch   zerocopy       copy       gloo   zc/copy   zc/gloo
fcn5            1      11.15       9.89      10.73     1.13x     1.04x

targets (tcp, smallest batch per model):
  fcn5 batch 1: zerocopy/copy = 1.13x (target >= 1.1x): met
  fcn5 batch 1: zerocopy/gloo = 1.04x (target >= 1.2x): NOT met
""",
    "demo.txt": """\
# command: tensorwire demo > bench/results/demo.txt   (step demo of tensorwire bench report)
# date: 2026-11-29 10:00-10:00 UTC, code abc1234, 2 CPUs, load average 0.50 at start, 0.60 at end
tensorwire demo: wrote a 64 MiB float32 tensor into pid 123 (transport auto) with one-sided writes
  bandwidth: 5,027 MB/s (best of 5, write + flush)
""",
}

README = f"""# project

intro text, kept

## Performance

hand-written text before the block, kept
{report.BEGIN}
stale text that the report replaces
{report.END}
hand-written text after the block, kept

<!-- bench-report:demo:begin -->
old demo output
<!-- bench-report:demo:end -->
the end
"""


def _checkout(tmp_path: pathlib.Path, files: dict[str, str] = FILES) -> pathlib.Path:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "README.md").write_text(README)
    for name, text in files.items():
        (tmp_path / "bench" / "results" / name).write_text(text)
    return tmp_path


def test_dry_run_lists_the_commands(capsys):
    assert cli.main(["bench", "report", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for command in (
        "tensorwire demo > bench/results/demo.txt",
        "bash bench/compare_ucx_perftest.sh --reps 3",
        "tensorwire bench tensor --transport shm --repeat 3 --no-progress "
        "--json bench/results/tensor_shm.json --plot bench/results/tensor_shm.png "
        "> bench/results/tensor_shm.txt",
        "tensorwire bench tensor --transport tcp",
        "tensorwire bench torch-dist --transport shm",
        "tensorwire bench torch-dist --transport tcp",
        "tensorwire bench train --transport shm --figures fig8 --batches 1 --steps 20",
        "tensorwire bench train --transport tcp --figures fig8 --batches 1 --steps 20",
    ):
        assert command in out, f"{command!r} not in:\n{out}"
    assert len([line for line in out.splitlines() if not line.startswith("#")]) == len(report.STEPS)
    assert cli.main(["bench", "report", "--dry-run", "--repeat", "1"]) == 0  # one pass: every step that repeats
    quick = capsys.readouterr().out
    assert "--reps 1" in quick and "--repeat 3" not in quick and "--repeat 2" not in quick, quick
    assert quick.count("--repeat 1") == out.count("--repeat ")
    # every file a step writes is one the README or bench/results/README.md names
    index = (ROOT / "bench" / "results" / "README.md").read_text()
    for step in report.STEPS:
        for name in step.files():
            assert name in index, f"{name} (step {step.name}) has no row in bench/results/README.md"


def test_only_selects_steps_in_order(capsys):
    assert cli.main(["bench", "report", "--dry-run", "--only", "train-tcp,tensor-tcp"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 2
    assert lines[0].startswith("tensorwire bench tensor --transport tcp")
    assert lines[1].startswith("tensorwire bench train --transport tcp")


def test_only_with_an_unknown_step_is_a_usage_error(capsys):
    assert cli.main(["bench", "report", "--dry-run", "--only", "tensor,bogus"]) == 2
    assert "--only takes demo, p2p" in capsys.readouterr().err


def test_readme_blocks_from_given_files(tmp_path):
    root = _checkout(tmp_path)
    assert report.update_readme(root)
    text = (root / "README.md").read_text()
    # the text around the blocks is untouched
    assert "intro text, kept" in text and "hand-written text before the block, kept" in text
    assert "hand-written text after the block, kept" in text and text.endswith("the end\n")
    assert "stale text" not in text and "old demo output" not in text
    block = text[text.index(report.BEGIN) : text.index(report.END)]
    for expected in (
        "[compare_ucx_perftest.txt](bench/results/compare_ucx_perftest.txt), 2026-11-21, median of 3 runs): "
        "2 of 2 ratios meet their targets",
        "PASS tcp `write_bw` 1 MiB: 6663.59 against 4485.32 MB/s of ucx_perftest ucp_put_bw, 1.49x (target >= 0.90x)",
        "PASS shm `write_lat` 8 B: 0.09 against 0.08 us of ucx_perftest ucp_put_lat, 0.88x",
        "[tensor_shm.txt](bench/results/tensor_shm.txt), 2026-11-22, code 51bfc75, best of 3): 2 of 3 bars met",
        "PASS `zerocopy >= 10x grpc`: 13.48x (worst of the 9 sizes it covers, at 8M; bar 10x)",
        "MISS `zerocopy >= ucx-tag`: 0.74x (worst of the 19 sizes it covers, at 8M; bar 1x)",
        "PASS `zerocopy transfer >= 0.9x memcpy`: 1.71x (at 256M; bar 0.9x)",
        "at 256M: zerocopy 11,638 MB/s; the other series' time over zerocopy's: dynamic 0.98x, copy 1.79x, "
        "grpc 32.93x; sanity checks PASS",
        "[torch_dist_shm.txt](bench/results/torch_dist_shm.txt), 2026-11-28, code e98b2b2): 1 of 2 targets met",
        "MISS send/recv 8 B latency <= 1/5 of gloo's: 3.12x",
        "PASS all_reduce 1M >= 2x gloo: 5.98x",
        "send/recv latency 3.12x (8 B); all_reduce 5.98x (1 MiB), 4.20x (16 MiB)",
        "[net_tcp_train_b1.txt](bench/results/net_tcp_train_b1.txt), 2026-11-27, code 5ede37a, best of 2): "
        "1 of 2 targets met",
        "fcn5 batch 1: zerocopy 11.15, copy 9.89, gloo 10.73 samples/s; zerocopy/gloo 1.04x (target >= 1.2x) "
        "MISS; zerocopy/copy 1.13x (target >= 1.1x) met",
        # files that are not there say how to make them
        "[tensor_tcp.txt](bench/results/tensor_tcp.txt): not measured yet (`tensorwire bench report --only "
        "tensor-tcp`)",
    ):
        assert expected in block, f"{expected!r} not in the block:\n{block}"
    demo = text[text.index(report.DEMO_BEGIN) : text.index(report.DEMO_END)]
    assert "tensorwire demo: wrote a 64 MiB float32 tensor into pid 123" in demo
    assert "bandwidth: 5,027 MB/s" in demo and "# command" not in demo
    # a second regeneration from the same files changes nothing
    assert not report.update_readme(root)
    assert (root / "README.md").read_text() == text


def test_readme_without_markers_is_an_error(tmp_path):
    root = _checkout(tmp_path)
    (root / "README.md").write_text("# no blocks here\n")
    with pytest.raises(report.BenchError, match="no <!-- bench-report:begin -->"):
        report.update_readme(root)


def test_a_step_moves_its_files_and_a_failed_one_keeps_the_old(tmp_path):
    root = _checkout(tmp_path, {"x.txt": "old\n", "x.json": "old"})
    write = (
        "import sys, pathlib; pathlib.Path(sys.argv[1], 'x.json').write_text('new'); "
        "print('PASS x measured'); sys.exit(int(sys.argv[2]))"
    )
    good = report.Step("x", "a test", (sys.executable, "-c", write, report.OUT, "0"), "x.txt", writes=("x.json",))
    r = report.run_step(good, root, timeout=60, keep_dir=tmp_path / "kept")
    assert r.ok and r.summary == "PASS x measured" and r.written == ["x.txt", "x.json"]
    txt = (root / "bench" / "results" / "x.txt").read_text()
    assert txt.startswith("# command: ") and "(step x of tensorwire bench report)" in txt
    assert "# date: " in txt and txt.endswith("PASS x measured\n")
    assert (root / "bench" / "results" / "x.json").read_text() == "new"
    (root / "bench" / "results" / "x.txt").write_text("old\n")
    bad = report.Step("x", "a test", (sys.executable, "-c", write, report.OUT, "3"), "x.txt", writes=("x.json",))
    r = report.run_step(bad, root, timeout=60, keep_dir=tmp_path / "kept")
    assert not r.ok and "exit 3" in r.summary
    assert (root / "bench" / "results" / "x.txt").read_text() == "old\n"
    assert (pathlib.Path(r.kept) / "x.json").read_text() == "new"


def test_the_readme_is_what_the_committed_files_say():
    """README.md's blocks are the rendering of the committed files: edit a number by hand, or
    commit a re-run without its README, and this fails (`tensorwire bench report --readme-only`)."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(report.BEGIN) + len(report.BEGIN) : text.index(report.END)]
    assert block.strip("\n") == report.render_block(ROOT / "bench" / "results").strip("\n")
    demo = text[text.index(report.DEMO_BEGIN) + len(report.DEMO_BEGIN) : text.index(report.DEMO_END)]
    assert demo.strip("\n") == report.render_demo(ROOT / "bench" / "results").strip("\n")


def test_every_step_is_a_command_the_cli_takes(tmp_path):
    """Each step's command line parses with the real parser (or names a script of the checkout),
    so a renamed flag fails here rather than ten minutes into a run."""
    parser = cli.build_parser()
    for step in report.STEPS:
        argv = step.command(str(tmp_path))
        if argv[0] == "tensorwire":
            args = parser.parse_args(argv[1:])
            assert callable(args.func), step.name
        else:
            assert (ROOT / argv[1]).exists(), f"{step.name}: {argv[1]} is not in the checkout"


def test_a_results_file_says_uncommitted_only_for_code(tmp_path):
    """The code a step ran is "uncommitted" only when code changed, not when the report itself
    has rewritten bench/results/ or README.md (in a scratch git repository)."""
    import subprocess

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for name in ("README.md", "bench/results/x.txt", "code.py"):
        (tmp_path / name).write_text("1\n")
    subprocess.run(git[:5] + ["init", "-q", str(tmp_path)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    assert report._code(tmp_path).startswith("code ") and "uncommitted" not in report._code(tmp_path)
    (tmp_path / "README.md").write_text("2\n")
    (tmp_path / "bench" / "results" / "x.txt").write_text("2\n")
    assert "uncommitted" not in report._code(tmp_path)
    (tmp_path / "code.py").write_text("2\n")
    assert report._code(tmp_path).endswith("+ uncommitted changes")


def test_torch_dist_targets_keep_their_compute_ceiling():
    """A training target's line carries its compute ceiling into the README (it says why a
    bar no transport could meet was missed); every target line counts."""
    text = "\n".join(
        [
            "# target send/recv 8 B latency <= 1/5 of gloo's: 5.48x PASS",
            "# target DDP FCN-5 batch 8 samples/s >= 1.3x gloo: 1.23x (compute ceiling 1.96x gloo) MISS",
            "MISS: 1 of 2 targets (DDP FCN-5 batch 8 samples/s >= 1.3x gloo)",
        ]
    )
    summary, lines = report.torch_dist_lines(text)
    assert summary == "1 of 2 targets met", summary
    assert "  * MISS DDP FCN-5 batch 8 samples/s >= 1.3x gloo: 1.23x (compute ceiling 1.96x gloo)" in lines, lines
