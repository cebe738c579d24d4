"""The tensorwire command line: one parser, built from the command modules.

The product and the lab: the product (the device API, tensorwire.ranks,
tensorwire.torch) never imports tensorwire.lab (the benchmarks, the paper's
harness, the testbed, the conformance runner), at module level or lazily. The
one exception is here: build_parser() looks the lab's command module up by
name (LAB_COMMANDS) and lets it register its commands, so that `tensorwire
bench ...`, `demo`, `testbed`, `train`, `partition` and `conformance` are
subcommands of the one `tensorwire` command (docs/architecture.md §4.1).

Every module in COMMAND_MODULES, and tensorwire.lab.commands's, has one
function, ``register(commands)``, that adds its parsers to ``commands.top`` (the subcommands of ``tensorwire``) or
``commands.bench`` (those of ``tensorwire bench``). Each command's parser sets,
with ``set_defaults``:

  func   called with the parsed arguments; returns the exit code (None: 0)
  needs  the optional dependencies it cannot run without, as (module, extra)
         or, when only an option needs it, (module, extra, option dest):
         one that is missing ends the command before it starts with
         "tensorwire train needs torch: pip install tensorwire[torch]", exit 2

Importing a command module must stay cheap (no torch, grpc or matplotlib):
the work is imported inside ``func``. A command whose optional dependency is
missing is still listed in --help.

Exit codes: func's own; 2 for a usage error (argparse's, or a func that stops
with SystemExit("message")), for a missing optional dependency and for an
output file (--json FILE, --plot FILE.png) that could not be written; 1 for a
tensorwire error; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__

# The product's own commands, in this order in --help. Each has register(commands).
COMMAND_MODULES = (
    "tensorwire.cli.info",  # tensorwire info
    "tensorwire.ranks.launch",  # tensorwire run
)

# The lab's commands (tensorwire bench ..., demo, testbed, train, partition,
# conformance) come after them through this one hook: the only place the product
# names the lab. The module is looked up by name and its register(commands)
# adds its parsers as the product's do; the lab imports the product, never the
# reverse (tests/python/project/test_layers.py). Without the lab the product's commands
# still run.
LAB_COMMANDS = "tensorwire.lab.commands"

# The extra of pyproject.toml that installs an optional dependency, for one that
# a command imports without having declared it in `needs`.
EXTRAS = {"torch": "torch", "grpc": "bench", "matplotlib": "bench", "sklearn": "train", "mpi4py": "mpi"}


class _Parser(argparse.ArgumentParser):
    """Every command's parser records its prog ("tensorwire bench train") in the
    parsed arguments, for the messages of main()."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(command_prog=self.prog)


class Commands:
    """What register() is given: `top`, the subparsers of `tensorwire`, and `bench`,
    those of `tensorwire bench`, made where first asked for (so that the order of
    COMMAND_MODULES is the order of --help)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.top = parser.add_subparsers(dest="command", required=True)
        self._bench: argparse._SubParsersAction[argparse.ArgumentParser] | None = None

    @property
    def bench(self) -> argparse._SubParsersAction[argparse.ArgumentParser]:
        if self._bench is None:
            p = self.top.add_parser("bench", help="benchmarks (perftest-style tables, --json reports)")
            self._bench = p.add_subparsers(dest="bench", required=True)
        return self._bench


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tensorwire",
        description="Zero-copy one-sided tensor transport over UCX, and the tools to measure the fabric under it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = Commands(parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    try:
        lab = importlib.import_module(LAB_COMMANDS)
    except ModuleNotFoundError as e:
        if e.name not in (LAB_COMMANDS, LAB_COMMANDS.rpartition(".")[0]):  # the lab itself is absent
            raise
    else:
        lab.register(commands)
    return parser


def missing_dependency(prog: str, needs, args: argparse.Namespace) -> str | None:
    """The message for the first of `needs` that cannot be imported (None if all can)."""
    import importlib.util

    for module, extra, *option in needs:
        if option and not getattr(args, option[0], None):
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            flag = f" --{option[0].replace('_', '-')}" if option else ""
            return f"{prog}{flag} needs {module}: pip install tensorwire[{extra}]"
    return None


# Options that name a file a command writes when it ends (after a sweep that may
# take minutes): checked before it starts.
OUTPUT_OPTIONS = ("json", "plot")


def unwritable_output(prog: str, args: argparse.Namespace) -> str | None:
    """The message for the first output file (--json FILE, --plot FILE.png) whose
    directory is missing or not writable (None if all can be written)."""
    import os

    for dest in OUTPUT_OPTIONS:
        path = getattr(args, dest, None)
        if not isinstance(path, str):  # absent, or a switch (info --json)
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"{prog} --{dest} {path}: is a directory, not a file"
        if not os.path.isdir(folder):
            return f"{prog} --{dest} {path}: the directory {folder} does not exist"
        if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            return f"{prog} --{dest} {path}: not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # main's own entries leave the arguments: a command sees only its options and func
    prog, needs = vars(args).pop("command_prog"), vars(args).pop("needs", ())
    why = missing_dependency(prog, needs, args) or unwritable_output(prog, args)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    from .. import errors

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)  # a command's own usage error
        return 2
    except ModuleNotFoundError as e:
        if e.name not in EXTRAS:  # not an optional dependency itself (a part of one missing: a broken install)
            raise
        print(f"{prog} needs {e.name}: pip install tensorwire[{EXTRAS[e.name]}]", file=sys.stderr)
        return 2
    except errors.Error as e:  # every tensorwire error type derives from it
        print(f"tensorwire: error: {e}", file=sys.stderr)
        return 1
