#!/usr/bin/env bash
# The GPU checks of issue 20, on a GPU machine (the device tool runs this from
# the repo root with .whl carried; bench/gpu/bundle.sh made it). Results go to
# $OUT (the device tool's folder; ./gpu-out elsewhere), at most 8 files.
#   bash bench/gpu/checks.sh [latency] [tensor] [tests] [table2]   (default: all four, in that order)
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/.whl/site LD_LIBRARY_PATH=$PWD/.whl/site/libucx/lib PYTHONUNBUFFERED=1 TENSORWIRE_PROGRESS_BAR=0
start=$(date +%s)
log=$out/checks.txt
step() { echo "== [$(( $(date +%s) - start ))s] $*" >> "$log"; }
{ date -u; nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"
  git log --oneline -1; timeout 30 python3 -m tensorwire info 2>&1 | head -12; } > "$log" 2>&1
for what in ${@:-latency tensor tests table2}; do
  case $what in
    latency)
      for args in "--memory cuda --series both" "--memory host --series both" "--memory cuda --progress-mode inline"; do
        step "slot_latency --transport shm --sizes 8,4K --iters 5000 $args"
        timeout 60 python3 -m tensorwire.lab.fabric.slot_latency --transport shm --sizes 8,4K --iters 5000 $args >> "$log" 2>&1
      done
      for kind in static dynamic; do for gap in 300e-6 3e-3; do
        step "idle receiver $kind $gap"
        timeout 60 python3 bench/micro/idle_oneway.py shm $gap cuda $kind >> "$log" 2>&1
      done; done ;;
    tensor)
      step "bench tensor --memory cuda --transport shm"
      timeout 150 python3 -m tensorwire bench tensor --memory cuda --transport shm --sizes 4K,64K,1M,16M,64M,256M \
        --json "$out/tensor_shm.json" > "$out/tensor_shm.txt" 2>&1
      step "bench tensor --memory cuda --transport tcp"
      timeout 100 python3 -m tensorwire bench tensor --memory cuda --transport tcp --sizes 4K,1M,16M,64M \
        --json "$out/tensor_tcp.json" > "$out/tensor_tcp.txt" 2>&1 ;;
    tests)
      step "GPU tests"
      timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu tests/python/core/test_gpu.py \
        tests/python/pytorch/test_ps_gpu.py tests/python/lab/test_bench_tensor_cuda.py tests/python/lab/test_bench_p2p.py \
        > "$out/tests.txt" 2>&1
      echo "pytest rc=$?" >> "$out/tests.txt" ;;
    table2)
      step "bench train --figures table2"
      timeout 240 python3 -m tensorwire bench train --figures table2 --models fcn5,alexnet,vgg16,inception3 \
        --steps 6 --warmup 2 --transport shm --device cuda --json "$out/table2.json" > "$out/table2.txt" 2>&1 ;;
    *) echo "unknown check '$what' (latency, tensor, tests, table2)" >&2; exit 2 ;;
  esac
done
step end
