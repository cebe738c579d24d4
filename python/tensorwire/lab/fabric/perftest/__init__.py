"""Fabric benchmarks in the anchor tools' semantics: `bench write_bw|read_bw`
(perftest ib_write_bw/ib_read_bw), `bench write_lat|read_lat` (ib_write_lat/
ib_read_lat) and `bench fullmesh` (the all-pairs ib_write_bw scripts of
seed 004). The point-to-point tests run against a peer spawned on loopback,
against `--connect HOST:PORT` (a `--server` elsewhere), or between ranks 0
and 1 under `tensorwire run -n 2` (which is how they cross testbed hosts).

The package, one job per file (its commands, and their aliases `bench latency|bw`,
`bench serve`: the passive side, are tensorwire.lab.commands.bench_fabric and
bench_p2p): ``peer.py`` finds the peer a test measures against (spawned, --connect'ed or
rank 1; the two sides talk ../p2p.py's protocol); ``measure.py`` runs the
bandwidth and latency tests; ``tables.py``
prints their tables in perftest's, OSU's or IMB's columns and ``plots.py``
plots them; ``comparisons.py`` holds the comparisons that
``python -m tensorwire.lab.fabric.perftest`` runs (``__main__.py``).
"""
