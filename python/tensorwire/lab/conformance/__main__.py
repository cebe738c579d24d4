"""python -m tensorwire.lab.conformance: the same command as `tensorwire conformance`."""

import argparse
import sys

import shlex

from . import __doc__ as DOC, add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m tensorwire.lab.conformance",
        description=DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    try:
        code = run(
            parser.parse_args(),
            prog=parser.prog,
            command=shlex.join(["python", "-m", "tensorwire.lab.conformance"] + sys.argv[1:]),
        )
    except SystemExit as e:  # a usage error's message: status 2, as argparse's and `tensorwire conformance`'s
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)
        code = 2
    sys.exit(code)
