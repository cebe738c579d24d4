#!/usr/bin/env bash
# Prepares a GPU session (docs/benchmarks.md, "On a lent GPU machine"): the GPU
# machine has Python 3.12, CUDA and torch but no network, so this builds a
# cp312 wheel of this tree here and unpacks it, with the libucx-cu13 wheel's
# libraries, into .whl/site (git-ignored, about 24 MiB: carry it).
#   bash bench/gpu/bundle.sh        (PY312=/path/to/python3.12 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/../.."
# python3.12 on PATH, else the newest pyenv 3.12
py312=${PY312:-$(command -v python3.12 >/dev/null && python3.12 -c "import sys" 2>/dev/null && echo python3.12 || ls -d ~/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1)}
venv=build/venv312
if [ ! -x "$venv/bin/python" ]; then
  "$py312" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "libucx-cu13>=1.22" "nanobind>=2" "scikit-build-core>=0.11.2" numpy cmake ninja
fi
rm -rf build/gpu-wheel
"$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w build/gpu-wheel .
ucx=$("$venv/bin/python" -c "import libucx, os; print(os.path.dirname(libucx.__file__))")
site=.whl/site
rm -rf "$site"
mkdir -p "$site/libucx/lib/ucx" "$site/libucx/bin"
cp "$ucx"/*.py "$site/libucx/"
# UCX loads by soname (libucp.so.0) and its modules by the name its own library was loaded with.
for lib in ucm ucp ucs ucs_signal uct; do cp "$ucx/lib/lib$lib.so.0" "$site/libucx/lib/"; done
for mod in "$ucx"/lib/ucx/lib*.so.0; do
  case $mod in *perftest*) continue ;; esac
  cp "$mod" "$site/libucx/lib/ucx/"
  cp "$mod" "$site/libucx/lib/ucx/$(basename "$mod" .0)"
done
cp "$ucx/bin/ucx_info" "$site/libucx/bin/"
cp -r "$ucx/../libucx_cu13.libs" "$site/"
(cd "$site" && python3 -m zipfile -e "$OLDPWD"/build/gpu-wheel/tensorwire-*.whl .)
du -sh .whl
