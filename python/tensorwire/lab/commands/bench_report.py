"""`tensorwire bench report` (tensorwire.lab.fabric.report): its options and help; the
steps, the runs and the README's blocks are the bench module's."""

from __future__ import annotations

import argparse

from ..fabric import report
from .args import arg_positive


def register(commands) -> None:
    p = commands.bench.add_parser(
        "report",
        help="re-measure the README's headline numbers (best of 3, about 28 min) and regenerate its blocks",
        description=report.__doc__
        + "\nsteps (--only NAME[,NAME]):\n"
        + report.steps_table()
        + "\n\nexamples:\n  tensorwire bench report --dry-run\n  tensorwire bench report            # or: make bench\n"
        "  tensorwire bench report --only tensor-tcp,train-tcp\n  tensorwire bench report --readme-only",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--only",
        metavar="NAME[,NAME]",
        help=f"run only these steps ({', '.join(report.STEP_NAMES)}); the README's blocks are "
        "still regenerated from every file",
    )
    p.add_argument(
        "--repeat",
        type=arg_positive,
        default=None,
        metavar="N",
        help="passes per comparison instead of each step's own (3: the project's best of 3, as the "
        "committed files; 1 takes about 11 min, and the files' command lines say so)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit (runs nothing)")
    p.add_argument(
        "--readme-only",
        action="store_true",
        help="run nothing: regenerate the README's blocks from the files in bench/results/",
    )
    p.add_argument("--no-readme", action="store_true", help="leave README.md as it is")
    p.add_argument(
        "--root",
        metavar="DIR",
        help="the checkout (default: the one this package is installed from, else the working directory)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds one step may take (default: 4x its usual time, at least 300)",
    )
    p.set_defaults(func=report.run)
