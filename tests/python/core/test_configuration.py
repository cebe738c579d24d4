"""One configuration story (docs/configuration.md): every environment variable is
TENSORWIRE_* with one meaning, listed once in tensorwire.config (which the document
mirrors and `tensorwire info` shows), and one progress-bar switch for every command
that draws one (--progress/--no-progress, handed to ranks as TENSORWIRE_PROGRESS_BAR)."""

from __future__ import annotations

import glob
import io
import json
import os
import re
import subprocess
import sys
import threading
import warnings

import pytest

from tensorwire import cli, config
from tensorwire.ranks import world
from tensorwire.lab.fabric.common import Progress, Table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PACKAGE = os.path.join(ROOT, "python", "tensorwire")
NAME = re.compile(r"\bTENSORWIRE_[A-Z0-9_]*[A-Z0-9]\b")
# TENSORWIRE_* words that are not environment variables.
NOT_VARIABLES = {"TENSORWIRE_ADDRESS": "the address line `bench serve` prints (bench/p2p.py)"}
CMAKE_OPTIONS = re.compile(r"TENSORWIRE_BUILD_[A-Z]+")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _package_files() -> list[str]:
    return sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))


def _terminal_run(
    args: list[str], timeout: float = 120, stdout_too: bool = False
) -> tuple[subprocess.CompletedProcess, str]:
    """`tensorwire ARGS` with stderr (and with stdout_too stdout) on a pseudo-terminal and no
    progress variable inherited: (the process, what reached the terminal)."""
    import pty

    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_PROGRESS")}
    got: list[bytes] = []

    def drain() -> None:  # never lets the writers block on a full terminal
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer closed its side
                return
            if not chunk:
                return
            got.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tensorwire", *args],
            stdout=follower if stdout_too else subprocess.PIPE,
            stderr=follower,
            text=True,
            timeout=timeout,
            env=env,
        )
    finally:
        os.close(follower)
    reader.join(10)
    os.close(leader)
    return proc, b"".join(got).decode(errors="replace")


# -- the table, the document, the code --


def test_the_document_mirrors_the_table():
    doc = _read(os.path.join(ROOT, "docs", "configuration.md"))
    for table in config.markdown_tables().strip().split("\n\n"):
        assert table in doc, (
            "docs/configuration.md differs from tensorwire.config: regenerate its tables "
            "with `python -m tensorwire.config`"
        )


def test_names_are_unique_and_all_tensorwire():
    names = [v.name for v in config.VARIABLES]
    assert len(names) == len(set(names))
    assert all(NAME.fullmatch(n) for n in names)


def test_python_reads_only_variables_of_the_table():
    """Every TENSORWIRE_* word in the package (reads, sets, docstrings) is in the table."""
    unknown = {}
    for path in _package_files():
        for name in set(NAME.findall(_read(path))) - config.NAMES - set(NOT_VARIABLES):
            unknown.setdefault(name, []).append(os.path.relpath(path, ROOT))
    assert not unknown, f"add these to tensorwire.config.VARIABLES (and docs/configuration.md): {unknown}"


def test_environment_reads_use_literal_known_names():
    """os.environ / getenv calls name a variable of the table (or another launcher's)."""
    read = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(|environ\[|getenv\()\s*["'](TENSORWIRE_\w+)""")
    for path in _package_files():
        for name in read.findall(_read(path)):
            assert name in config.NAMES, f"{os.path.relpath(path, ROOT)} reads {name}, not in tensorwire.config"


def test_the_core_reads_what_the_table_says():
    src = "".join(_read(p) for p in glob.glob(os.path.join(ROOT, "cpp", "src", "**", "*.cc"), recursive=True))
    read = set(re.findall(r'getenv\("(TENSORWIRE_\w+)"\)', src))
    core = {v.name for v in config.VARIABLES if v.reader == config.CORE}
    assert read == core, read ^ core


def test_docs_name_only_variables_of_the_table():
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        text = CMAKE_OPTIONS.sub("", _read(path))
        unknown = set(NAME.findall(text)) - config.NAMES - set(NOT_VARIABLES)
        assert not unknown, f"{os.path.relpath(path, ROOT)} names {unknown}"


def test_no_old_tw_names_remain():
    """TW_* environment variables are gone (TW_LOG_*, TW_UCX_SOURCE, TW_UCX_HAS_*, TW_FUZZ_CHECK are
    C++ macros; docs/configuration.md lists the old names in its table of renames)."""
    old = re.compile(r"\bTW_(?!LOG_|UCX_SOURCE\b|UCX_HAS_|FUZZ_CHECK\b)[A-Z][A-Z0-9_]*")
    paths = [
        *_package_files(),
        *glob.glob(os.path.join(ROOT, "tests", "python", "*.py")),
        os.path.join(ROOT, "README.md"),
        os.path.join(ROOT, "Makefile"),
        *glob.glob(os.path.join(ROOT, "docs", "*.md")),
        *glob.glob(os.path.join(ROOT, "bench", "*.sh")),
    ]
    skip = {os.path.join(ROOT, "docs", "configuration.md"), os.path.abspath(__file__)}
    found = {os.path.relpath(p, ROOT): old.findall(_read(p)) for p in paths if p not in skip}
    assert not {p: f for p, f in found.items() if f}


def test_an_old_launcher_name_is_not_read_and_says_so(monkeypatch):
    monkeypatch.setattr(world, "_warned_retired", False)
    with pytest.warns(UserWarning, match="TW_RANK, TW_SIZE no longer read: tensorwire reads TENSORWIRE_RANK"):
        p = world.detect({"TW_RANK": "1", "TW_SIZE": "2"})
    assert (p.rank, p.size, p.launcher) == (0, 1, "single")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        world.detect({"TW_RANK": "1", "TW_SIZE": "2"})


def test_info_shows_every_variable_with_its_value():
    env = dict(os.environ, TENSORWIRE_LOG="error", TENSORWIRE_NO_SUCH_THING="1")
    env.pop("TENSORWIRE_SPIN_US", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tensorwire", "info", "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    shown = {c["name"]: c for c in data["configuration"]}
    assert list(shown) == [v.name for v in config.VARIABLES]
    assert shown["TENSORWIRE_LOG"] == {"name": "TENSORWIRE_LOG", "value": "error", "set": True}
    assert shown["TENSORWIRE_SPIN_US"]["set"] is False
    assert shown["TENSORWIRE_SPIN_US"]["value"] == config.variable("TENSORWIRE_SPIN_US").default
    assert any("TENSORWIRE_NO_SUCH_THING" in w for w in data["warnings"])


# -- the progress bar: one switch, one variable, one implementation --


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "write_bw"],
        ["bench", "latency"],
        ["bench", "tensor"],
        ["bench", "fullmesh"],
        ["bench", "alltoall"],
        ["bench", "allreduce"],
        ["bench", "terasort"],
        ["train"],
    ],
)
def test_every_command_that_draws_a_bar_has_the_switch(command):
    parser = cli.build_parser()
    assert parser.parse_args(command).progress is None  # default: decided by the terminal
    assert parser.parse_args([*command, "--progress"]).progress is True
    assert parser.parse_args([*command, "--no-progress"]).progress is False


def test_the_switch_then_the_variable_then_the_terminal(monkeypatch):
    monkeypatch.setenv(config.PROGRESS_BAR, "1")
    assert config.progress_bar(None) is True and config.progress_bar(False) is False
    monkeypatch.setenv(config.PROGRESS_BAR, "0")
    assert config.progress_bar(None) is False and config.progress_bar(True) is True
    monkeypatch.delenv(config.PROGRESS_BAR)
    assert config.progress_bar(None) is sys.stderr.isatty()
    assert config.export_progress_bar(True) is True and os.environ[config.PROGRESS_BAR] == "1"


def test_off_a_terminal_the_bar_is_whole_lines(capsys):
    bar = Progress(2, "sweep", True)
    bar.step("4K")
    bar.step("1M")
    Progress(2, "quiet", False).step("4K")
    err = capsys.readouterr().err
    assert "\r" not in err and "quiet" not in err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("sweep [") and " 2/2 1M" in lines[1]


def _screen(text: str) -> list[str]:
    """The lines a terminal shows: a carriage return goes back to the line's start,
    and what follows overwrites what was there."""
    shown = []
    for raw in text.replace("\r\n", "\n").split("\n"):
        line = ""
        for part in raw.split("\r"):
            line = part + line[len(part) :]
        shown.append(line.rstrip())
    return shown


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_row_printed_under_the_bar_is_not_garbled(monkeypatch):
    """On a terminal the bar is redrawn in place on the last line: a table row printed
    meanwhile (stdout, same terminal) clears that line first and the bar comes back
    below it."""
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", term)
    bar = Progress(3, "sweep", True)
    table = Table(" #bytes  t[usec]", progress=bar)
    for size in (8, 16, 32):
        table.line(f" {size:<7} 1.00")
        bar.step(str(size))
    table.close()
    shown = [line for line in _screen(term.getvalue()) if line]
    rows = [line for line in shown if line.split()[0].isdigit()]
    assert rows == [" 8       1.00", " 16      1.00", " 32      1.00"]
    assert shown[:2] == shown[-1:] + [" #bytes  t[usec]"] == ["-" * 87, " #bytes  t[usec]"]
    assert re.fullmatch(r"sweep \[#+\] 3/3 32 +\d+\.\ds", shown[-2])  # the finished bar, on its own line


def test_a_sweep_on_a_terminal_prints_clean_rows_and_the_bar():
    """The same through the command line: bench write_lat with stdout and stderr on one terminal."""
    proc, terminal = _terminal_run(
        ["bench", "write_lat", "--transport", "tcp", "-s", "8,16,32", "-n", "200"], stdout_too=True
    )
    assert proc.returncode == 0, terminal
    shown = _screen(terminal)
    rows = [line for line in shown if re.match(r" (8|16|32) +200 ", line)]
    assert [r.split()[0] for r in rows] == ["8", "16", "32"], terminal
    assert any(line.startswith("write_lat [") for line in shown), terminal
    assert not any("write_lat [" in line and not line.startswith("write_lat [") for line in shown), terminal


TERASORT = ["bench", "terasort", "--rows", "20k", "--ranks", "2", "--transport", "tcp", "--samples", "2000"]


def test_terasort_on_a_terminal_draws_the_bar_and_leaves_the_devices_alone():
    """stderr on a terminal: the bar is on, rank 0 draws it (its stderr reaches the terminal
    through the launcher, as lines). The bench used to set TENSORWIRE_PROGRESS=1 for that,
    which is every Device's progress mode, and every rank then failed to open its device."""
    proc, terminal = _terminal_run(TERASORT)
    assert proc.returncode == 0, proc.stdout + terminal
    assert re.search(r"^PASS terasort tcp 20000 rows", proc.stdout, re.M), proc.stdout
    assert "must be blocking, polling or inline" not in terminal
    steps = re.findall(r"\[rank 0\] terasort \[[#.]+\] (\d)/5 ", terminal)
    assert steps == ["1", "2", "3", "4", "5"], terminal
    assert "[rank 1] terasort [" not in terminal


def test_terasort_no_progress_draws_none_on_a_terminal():
    proc, terminal = _terminal_run([*TERASORT, "--no-progress"])
    assert proc.returncode == 0, proc.stdout + terminal
    assert "terasort [" not in terminal, terminal


def test_terasort_progress_off_a_terminal():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_PROGRESS")}
    proc = subprocess.run(
        [sys.executable, "-m", "tensorwire", *TERASORT, "--progress"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(re.findall(r"\[rank 0\] terasort \[[#.]+\] \d/5 ", proc.stderr)) == 5, proc.stderr
