#!/usr/bin/env bash
# Runs tensorwire's bench write_bw/write_lat and ucx_perftest (the same UCX, the same
# UCX_TLS, loopback devices), plus a plain TCP socket stream, and prints the
# ratios of the core issue. Output and JSON go to bench/results/.
#   usage: bench/compare_ucx_perftest.sh [--reps N] [--transports tcp,shm]
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/compare_ucx_perftest
mkdir -p bench/results
{
  echo "# command: bench/compare_ucx_perftest.sh $*"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ) host: $(hostname) cpus: $(nproc)"
  python3 -m tensorwire info | sed 's/^/# /'
  python3 -m tensorwire.lab.fabric.compare --json "$out.json" "$@"
} 2>&1 | tee "$out.txt"
