"""The tensorwire command line (filled in below)."""
import sys


def main(argv=None) -> int:
    from .bench.cli import run
    return run(sys.argv[1:] if argv is None else argv)
