#!/usr/bin/env bash
# Sibling of compare_ucx_perftest.sh: `tensorwire bench write_bw` vs
# `ucx_perftest -t ucp_put_bw` (same UCX, UCX_TLS and loopback devices, same
# size, iterations and window) at >= 1 MiB; target >= 0.95x.
#   usage: bench/compare_write_bw.sh [--reps N] [--transports tcp,shm] [--sizes 1M,4M,16M]
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/write_bw_vs_ucx_perftest
mkdir -p bench/results
{
  echo "# command: bench/compare_write_bw.sh $*"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ) host: $(hostname) cpus: $(nproc) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  python3 -m tensorwire.lab.fabric.perftest compare-ucx-perftest --json "$out.json" "$@"
} 2>&1 | tee "$out.txt"
