#!/usr/bin/env bash
# Issue 49 item 6: tensorwire's static-slot one-way latency over tcp (through the Python API)
# alternating with UCX's own ucp_am_lat over tcp, and the same slot over shm (the Python
# calls' own share), 3 rounds; take each one's best typical. Prints to stdout.
#   usage: bench/slot_vs_am_lat.sh > bench/results/slot_latency_tcp_vs_am_lat.txt
set -uo pipefail
UCXBIN=$(python3 -c "import libucx,os;print(os.path.dirname(libucx.__file__))")/bin
export LD_LIBRARY_PATH="$(dirname "$UCXBIN")/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for round in 1 2 3; do
  echo "## round $round: tensorwire slot_latency --transport tcp"
  python3 -m tensorwire.lab.fabric.slot_latency --transport tcp --sizes 8,4K 2>&1 | grep -v "^$"
  echo "## round $round: tensorwire slot_latency --transport shm (the Python API alone)"
  python3 -m tensorwire.lab.fabric.slot_latency --transport shm --sizes 8,4K 2>&1 | grep "^ slot"
  echo "## round $round: ucp_am_lat over tcp (UCX_TLS=tcp UCX_NET_DEVICES=lo), 8 B and 4 KiB"
  for s in 8 4096; do
    UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 60 "$UCXBIN/ucx_perftest" -t ucp_am_lat -s $s -n 20000 -p 13377 >/dev/null 2>&1 &
    sleep 0.7
    UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 60 "$UCXBIN/ucx_perftest" -t ucp_am_lat -s $s -n 20000 -p 13377 127.0.0.1 2>&1 | grep "Final:"
    wait
  done
done
