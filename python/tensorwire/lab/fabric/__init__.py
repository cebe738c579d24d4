"""The fabric benchmark suite (`tensorwire bench ...`): ``p2p`` (the two sides
of the point-to-point tests) with ``perftest/`` (write_bw|read_bw|write_lat|
read_lat in perftest's semantics), ``tensor/`` (tensor transports compared),
``fullmesh``, the collectives (``_coll_*``), terasort (``teragen``,
``_terasort_*``), ``slot_latency``, ``tcp_stream``, ``compare``
(against ucx_perftest) and ``report`` (bench/results/README.md). ``common``
holds what they share. The commands are tensorwire.lab.commands.bench_*."""
