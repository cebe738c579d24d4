"""What every command's parser shares: the argparse types (a bad value is a
usage error, exit 2), the --progress switch, the `needs` entry of --plot and
deprecated spellings of renamed flags.
Cheap to import (the CLI builds every parser at start-up).

One flag, one meaning (docs/benchmarks.md, "Flags"): a flag that an anchor
tool defines (perftest, OSU, IMB, mpirun) means what it means there; any
other has one meaning in every `tensorwire bench` command, with the same
dest, type and nargs (tests/python/project/test_cli.py walks every parser). So
`--ranks` is a count of ranks everywhere, a sweep has its own flag
(`--sweep-ranks`), and `-n` is perftest's iterations. An old spelling stays,
hidden and warning, only where a committed results file or doc uses it
(`deprecated_alias`)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ..fabric.common import parse_size, parse_sizes

# A `needs` entry of a command with --plot (tensorwire.cli): without matplotlib it stops
# before measuring, "... --plot needs matplotlib: pip install tensorwire[bench]", exit 2.
PLOT_NEEDS = ("matplotlib", "bench", "plot")


def usage_error(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type: its ValueError becomes a usage error."""

    def arg(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    arg.__name__ = parse.__name__
    return arg


arg_size = usage_error(parse_size)
arg_sizes = usage_error(parse_sizes)


def arg_seconds(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v


def arg_positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def arg_counts(text: str) -> list[int]:
    """A comma list of positive counts: '2,3,4' (a sweep's values)."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes numbers like 2,4,8, not {text!r}") from None
    if not counts or any(c <= 0 for c in counts):
        raise argparse.ArgumentTypeError(f"takes numbers > 0 like 2,4,8, not {text!r}")
    return counts


def arg_nonneg(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def parse_rate(text: str) -> float:
    """A link rate in bytes/s from '25G', '25gbit', '100Gb/s', '1gbit', '400M' (bits/s, like tc)."""
    t = text.strip().lower().replace("/s", "").replace("bps", "").replace("bit", "").rstrip("b")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    try:
        if t and t[-1] in scale:
            return float(t[:-1]) * scale[t[-1]] / 8
        return float(t) / 8
    except ValueError:
        raise ValueError(f"bad rate {text!r}: use e.g. 1gbit, 25G, 100Gb/s") from None


arg_rate = usage_error(parse_rate)  # a link rate: "10G", "25Gbit", ...


def add_progress_switch(parser: Any) -> None:
    """--progress/--no-progress on a command that draws a Progress bar (one switch for all)."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw a progress bar on stderr (default: when stderr is a terminal, or as "
        "TENSORWIRE_PROGRESS_BAR=0|1 says; ranks and processes it starts inherit the choice)",
    )


class DeprecatedAlias(argparse.Action):
    """An old spelling of a renamed flag: hidden from --help, it stores into the
    new flag's dest (through its type) and says on stderr what to write instead."""

    def __init__(self, option_strings, dest, replacement: str = "", why: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.replacement, self.why = replacement, why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import sys

        print(f"{parser.prog}: {option_string} is deprecated: write {self.replacement} ({self.why})", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, *old: str, replacement: str, why: str) -> None:
    """Adds `old` as a deprecated spelling of `replacement`, an option `parser`
    already has: same dest, type and nargs, hidden, warning when used."""
    new = parser._option_string_actions[replacement]
    typed: dict[str, Any] = {"type": new.type} if new.type is not None else {}  # (add_argument's default: none)
    parser.add_argument(
        *old,
        action=DeprecatedAlias,
        dest=new.dest,
        nargs=new.nargs,
        metavar=new.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        replacement=replacement,
        why=why,
        **typed,
    )
