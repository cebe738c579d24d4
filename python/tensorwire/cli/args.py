"""What every command's parser shares: the argparse types (a bad value is a
usage error, exit 2), the --progress switch and the `needs` entry of --plot.
Cheap to import (the CLI builds every parser at start-up)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ..bench.common import parse_size, parse_sizes

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
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="draw a progress bar on stderr (default: when stderr is a terminal, or as "
                             "TENSORWIRE_PROGRESS_BAR=0|1 says; ranks and processes it starts inherit the choice)")
