"""`python -m tensorwire.lab.fabric.perftest compare-ucx-perftest|transport-comparison`."""

import sys

from .comparisons import compare_ucx_perftest, transport_comparison

if __name__ == "__main__":
    if sys.argv[1:2] == ["compare-ucx-perftest"]:
        sys.exit(compare_ucx_perftest(sys.argv[2:]))
    if sys.argv[1:2] == ["transport-comparison"]:
        sys.exit(transport_comparison(sys.argv[2:]))
    sys.exit("usage: python -m tensorwire.lab.fabric.perftest compare-ucx-perftest|transport-comparison [--help]")
