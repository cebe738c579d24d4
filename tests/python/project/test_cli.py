"""The command line's one registration mechanism (tensorwire.cli): every command
module's commands are in --help, usage errors and missing optional
dependencies exit 2 with one line, --version prints the version."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys

import pytest

import tensorwire
from tensorwire import cli
from tensorwire.lab import commands as lab_commands

OPTIONAL = ("torch", "grpc", "matplotlib", "sklearn", "mpi4py")


def tw(*args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`tensorwire ARGS` in a fresh interpreter where the modules in `block` cannot be imported."""
    code = (
        "import sys\n"
        f"for m in {block!r}: sys.modules[m] = None  # import m: ModuleNotFoundError\n"
        "from tensorwire.cli import main\n"
        f"sys.exit(main({list(args)!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def _commands_of(module: str) -> tuple[list[str], list[str]]:
    """(top-level commands, bench commands) that one command module registers."""
    commands = cli.Commands(argparse.ArgumentParser(prog="tensorwire"))
    importlib.import_module(module).register(commands)
    top = [n for n in commands.top.choices if n != "bench"]
    return top, (list(commands.bench.choices) if "bench" in commands.top.choices else [])


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for a in subs:
        for name, sub in a.choices.items():
            yield from _leaves(sub, path + (name,))


def test_every_command_module_is_in_help():
    top_help = tw("--help")
    bench_help = tw("bench", "--help")
    assert top_help.returncode == 0 and bench_help.returncode == 0
    for module in cli.COMMAND_MODULES + lab_commands.COMMAND_MODULES:  # the product's, then the lab's
        top, bench = _commands_of(module)
        assert top or bench, f"{module} registers no command"
        for name in top:
            assert f"    {name} " in top_help.stdout, f"{name} ({module}) missing from tensorwire --help"
        for name in bench:
            assert f"    {name} " in bench_help.stdout, f"bench {name} ({module}) missing from --help"


def test_every_command_has_a_handler():
    leaves = dict(_leaves(cli.build_parser()))
    assert ("train",) in leaves and ("bench", "latency") in leaves and ("testbed", "up") in leaves
    for path, parser in leaves.items():
        assert callable(parser.get_default("func")), f"tensorwire {' '.join(path)} has no func"
        assert parser.get_default("command_prog") == " ".join(("tensorwire",) + path)


def test_help_lists_commands_whose_dependency_is_missing():
    r = tw("--help", block=OPTIONAL)
    assert r.returncode == 0, r.stderr
    for name in ("train", "partition", "testbed", "run", "info"):
        assert f"    {name} " in r.stdout
    r = tw("bench", "--help", block=OPTIONAL)
    assert "    train " in r.stdout and "    tensor " in r.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--list"], "tensorwire train needs torch: pip install tensorwire[torch]"),
        (["partition", "--plan"], "tensorwire partition needs torch: pip install tensorwire[torch]"),
        (["bench", "train"], "tensorwire bench train needs torch: pip install tensorwire[train]"),
    ],
)
def test_missing_torch_names_the_extra_and_exits_2(argv, message):
    r = tw(*argv, block=("torch",))
    assert r.returncode == 2, r.stderr
    assert r.stderr == message + "\n"  # one line, no traceback
    assert r.stdout == ""


def test_missing_matplotlib_for_plot(tmp_path):
    png = str(tmp_path / "p.png")
    r = tw("bench", "latency", "--plot", png, block=("matplotlib",))
    assert (
        r.returncode == 2
        and r.stderr == "tensorwire bench latency --plot needs matplotlib: pip install tensorwire[bench]\n"
    )
    for command in (["bench", "tensor"], ["bench", "fullmesh"], ["bench", "terasort"], ["bench", "alltoall"]):
        r = tw(*command, "--plot", png, block=("matplotlib",))
        assert (
            r.returncode == 2
            and r.stderr == f"tensorwire {' '.join(command)} --plot needs matplotlib: pip install tensorwire[bench]\n"
        )


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch's own message comes first without it")
@pytest.mark.parametrize("command", [["bench", "train"], ["partition"]])
def test_missing_matplotlib_for_the_torch_commands_plot(command, tmp_path):
    r = tw(*command, "--plot", str(tmp_path / "p.png"), block=("matplotlib",))
    assert (
        r.returncode == 2
        and r.stdout == ""
        and r.stderr == f"tensorwire {' '.join(command)} --plot needs matplotlib: pip install tensorwire[bench]\n"
    )
    assert not list(tmp_path.iterdir())


def test_an_undeclared_optional_import_is_one_line_too(monkeypatch, capsys):
    """A command that imports an optional dependency it did not declare in `needs`."""

    def needs_sklearn(args):
        assert sorted(vars(args)) == ["command", "func", "json", "transport"]  # no entries of main's own
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")

    monkeypatch.setattr(importlib.import_module("tensorwire.cli.info"), "_main", needs_sklearn)
    assert cli.main(["info"]) == 2
    assert capsys.readouterr().err == "tensorwire info needs sklearn: pip install tensorwire[train]\n"


def test_every_error_type_is_a_tensorwire_error():
    """Every exception class the package defines derives from tensorwire.Error
    (the CLI catches that one class), the areas' own included."""
    import inspect
    import pkgutil

    found = {}
    for m in pkgutil.walk_packages(tensorwire.__path__, "tensorwire."):
        needs_torch = m.name.startswith(("tensorwire.torch", "tensorwire.lab.paper", "tensorwire.lab.torch_dist."))
        if m.name.endswith("__main__") or (needs_torch and importlib.util.find_spec("torch") is None):
            continue
        mod = importlib.import_module(m.name)
        for obj in vars(mod).values():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == mod.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    assert [name for name, cls in found.items() if not issubclass(cls, tensorwire.Error)] == []
    expected = {"RoleError", "BenchError", "TestbedError"}
    if importlib.util.find_spec("torch") is not None:
        expected |= {"PSError", "PartitionError"}
    assert expected <= {name.rsplit(".", 1)[1] for name in found}


def test_the_product_command_runs_without_the_lab():
    """The product's commands (info, run) need nothing of the lab, which registers the
    rest through tensorwire.cli's one hook: without it they are listed and run, and
    `run --testbed` (a testbed is the lab's) says what it needs."""
    r = tw("--help", block=("tensorwire.lab",))
    assert r.returncode == 0, r.stderr
    assert "{info,run}" in r.stdout  # the product's commands, none of the lab's
    r = tw("run", "-n", "1", "--", sys.executable, "-c", "print('ran')", block=("tensorwire.lab",))
    assert r.returncode == 0 and r.stdout.strip() == "ran", r.stderr
    r = tw("run", "-n", "1", "--testbed", "tw", "--", "true", block=("tensorwire.lab",))
    assert r.returncode == 2 and "--testbed needs the lab" in r.stderr, r.stderr


def test_demo_writes_and_verifies():
    """`tensorwire demo`: its receiver is a role of tensorwire.ranks.roles (no process of its own making)."""
    r = tw("demo", "--mib", "1", "--transport", "shm")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "contents:  verified" in r.stdout, r.stdout


def test_version():
    r = tw("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tensorwire {tensorwire.__version__}"
    r = subprocess.run([sys.executable, "-m", "tensorwire", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"tensorwire {tensorwire.__version__}"


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "the following arguments are required: command"),
        (["nosuch"], "invalid choice: 'nosuch'"),
        (["bench"], "the following arguments are required: bench"),
        (["bench", "latency", "--sizes", "x"], "bad size 'x'"),
        (["train", "--model", "nope"], "invalid choice: 'nope'"),
        (["run", "-n", "2"], "give the command after --"),  # the command's own check
        (["run", "-n", "1", "--hosts", "h1", "--", "true"], "give --testbed NAME too"),  # SystemExit("...")
    ],
)
def test_usage_errors_exit_2(argv, says):
    r = tw(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "write_bw", "--json", "/nonexistent-dir/x.json"], "the directory /nonexistent-dir does not exist"),
        (["bench", "tensor", "--plot", "/nonexistent-dir/x.png"], "the directory /nonexistent-dir does not exist"),
        (["bench", "write_lat", "--json", "/tmp"], "is a directory"),
    ],
)
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(argv, says):
    """A sweep may take minutes: its --json/--plot file is checked before it starts."""
    r = tw(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert says in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_building_the_parser_imports_no_optional_dependency():
    code = (
        "import sys\nfrom tensorwire.cli import build_parser\nbuild_parser()\n"
        f"print(sorted(k for k in sys.modules if k.split('.')[0] in {OPTIONAL!r}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_every_option_of_every_command_has_help():
    """--help explains every option of every command."""
    import argparse

    from tensorwire.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)) and action.help is None:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "tensorwire")
    assert missing == []


# ---- one flag, one meaning (issue 36 item 5; docs/benchmarks.md "Flags") ----

# What the anchor tools' flags mean here: perftest (ib_write_bw ...), OSU, mpirun.
ANCHORED = {
    "-s": "sizes",
    "-a": "all",
    "-n": "iters",
    "-q": "lanes",
    "-t": "window",
    "-D": "duration",
    "-f": "margin",
    "-b": "bidirectional",
    "-N": "no_peak",
    "-d": "net_devices",
    "-p": "port",  # perftest
    "-i": "iters",
    "-x": "warmup",
    "-c": "validate",  # OSU
    "-np": "ranks",  # mpirun
}
# Anchor flags no command may give another meaning.
RESERVED = {"-F": "perftest's CPU-frequency switch"}
# Old spellings kept because a committed results file uses them (args.deprecated_alias).
DEPRECATED = {
    ("fullmesh", "--ranks"): "--sweep-ranks",  # bench/results/fullmesh_loopback.txt
    ("alltoall", "-n"): "--ranks",
    ("allreduce", "-n"): "--ranks",
}  # bench/results/coll_wait_before_after.txt


def _bench_parsers(parser: argparse.ArgumentParser | None = None):
    for path, leaf in _leaves(parser or cli.build_parser()):
        if path[0] == "bench":
            yield path[1], leaf


def _meaning(action: argparse.Action) -> tuple:
    return (action.dest, getattr(action.type, "__name__", action.type), action.nargs, type(action).__name__)


def _clashes(parsers) -> dict:
    """{flag: {meaning: [commands]}} for every flag with more than one meaning."""
    from tensorwire.lab.commands.args import DeprecatedAlias

    seen: dict = {}
    types: dict = {}  # (flag, type name) -> the type objects: one name, two functions is a clash too
    for name, parser in parsers:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, DeprecatedAlias)):
                continue
            for flag in action.option_strings:
                seen.setdefault(flag, {}).setdefault(_meaning(action), []).append(name)
                types.setdefault((flag, _meaning(action)), set()).add(action.type)
    out = {flag: meanings for flag, meanings in seen.items() if len(meanings) > 1}
    for (flag, meaning), objs in types.items():
        if len(objs) > 1:
            out.setdefault(flag, {})[meaning + ("two type functions",)] = sorted(map(str, objs))
    return out


def test_every_bench_flag_means_one_thing_in_every_command():
    """Every flag of every `tensorwire bench` command has the same dest, type, nargs and action wherever it
    appears: `--ranks` is a count everywhere (a sweep is --sweep-ranks), `--workers` is bench train's
    processes (a device's UCP workers are --ucp-workers), `--timeout` one wait or step."""
    parsers = list(_bench_parsers())
    assert len(parsers) >= 15, [n for n, _ in parsers]
    assert _clashes(parsers) == {}
    shared = {
        flag
        for flag in ("--ranks", "--sizes", "--iters", "--warmup", "--repeat", "--timeout", "--steps")
        if sum(flag in p._option_string_actions for _, p in parsers) >= 2
    }
    assert shared == {"--ranks", "--sizes", "--iters", "--warmup", "--repeat", "--timeout", "--steps"}


def test_the_flag_check_finds_a_clash():
    """The check above is real: two commands that give one flag two meanings are reported."""
    root = argparse.ArgumentParser(prog="t")
    sub = root.add_subparsers().add_parser("bench").add_subparsers()
    a, b, c = sub.add_parser("a"), sub.add_parser("b"), sub.add_parser("c")
    a.add_argument("--ranks", type=int)
    b.add_argument("--ranks", type=str)  # a sweep spelled like a count
    a.add_argument("--warmup", type=int)
    c.add_argument("--warmup", type=int, dest="warm")  # same type, other dest
    a.add_argument("--json")
    c.add_argument("--json")
    assert set(_clashes(_bench_parsers(root))) == {"--ranks", "--warmup"}


def test_anchor_flags_follow_their_anchor():
    for name, parser in _bench_parsers():
        for flag, action in parser._option_string_actions.items():
            if flag in ANCHORED and (name, flag) not in DEPRECATED:
                assert action.dest == ANCHORED[flag], f"bench {name} {flag} is {action.dest}, not {ANCHORED[flag]}"
            assert flag not in RESERVED, f"bench {name} {flag}: that is {RESERVED[flag]}"


def test_deprecated_spellings_are_hidden_warn_and_mean_the_new_flag(capsys):
    from tensorwire.lab.commands.args import DeprecatedAlias

    found = {}
    for name, parser in _bench_parsers():
        for action in parser._actions:
            if isinstance(action, DeprecatedAlias):
                assert action.help == argparse.SUPPRESS
                new = parser._option_string_actions[action.replacement]
                assert _meaning(new)[:3] == _meaning(action)[:3] and new.type is action.type
                for flag in action.option_strings:
                    found[(name, flag)] = action.replacement
    assert found == DEPRECATED
    parser = cli.build_parser()
    old = parser.parse_args(["bench", "fullmesh", "--ranks", "2,3"])
    assert "fullmesh: --ranks is deprecated: write --sweep-ranks (" in capsys.readouterr().err
    assert old.sweep_ranks == parser.parse_args(["bench", "fullmesh", "--sweep-ranks", "2,3"]).sweep_ranks == [2, 3]
    old = parser.parse_args(["bench", "alltoall", "-n", "3"])
    assert "alltoall: -n is deprecated: write --ranks (" in capsys.readouterr().err
    assert old.ranks == parser.parse_args(["bench", "alltoall", "-np", "3"]).ranks == 3
    assert parser.parse_args(["bench", "write_bw", "-n", "7"]).iters == 7


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "fullmesh", "-s", "64K,1M"], "a fullmesh run streams one size, got 2"),
        (["bench", "fullmesh", "--sweep-ranks", "2,x"], "takes numbers like 2,4,8"),
        (["bench", "tensor", "--sizes", "6"], "multiples of 4 B"),
        (["bench", "tensor", "--warmup", "-1"], "must be >= 0"),
        (["bench", "write_bw", "-F", "osu"], "unrecognized arguments: -F"),
    ],
)
def test_flag_values_refused_with_a_usage_error(argv, says, capsys):
    try:
        code = cli.main(argv)  # the command's own check
    except SystemExit as e:  # the parser's
        code = e.code
    assert code == 2
    assert says in capsys.readouterr().err
