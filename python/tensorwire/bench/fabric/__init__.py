"""Fabric benchmarks (see cli.py's doc). fabric.py moved here whole, as cli.py, so that its
history follows; the next commit splits it by job."""

from .cli import (TRANSPORTS, _in_world, _positive, _rate, _seconds, _sizes,  # noqa: F401
                  add_commands, plot_bw, plot_lat)
