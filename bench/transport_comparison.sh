#!/usr/bin/env bash
# Seed 003's transport comparison on one host: tcp vs shared memory latency
# (write_lat, read_lat at 8 B and 4 KiB) and one-/two-way bandwidth (write_bw
# at 64 KiB, 1 MiB, 16 MiB), all validated. Output and JSON go to bench/results/.
#   usage: bench/transport_comparison.sh [--reps N] [--transports tcp,shm]
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/transport_comparison
mkdir -p bench/results
{
  echo "# command: bench/transport_comparison.sh $*"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ) host: $(hostname) cpus: $(nproc) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  python3 -m tensorwire info | sed 's/^/# /'
  python3 -m tensorwire.lab.fabric.perftest transport-comparison --json "$out.json" "$@"
} 2>&1 | tee "$out.txt"
