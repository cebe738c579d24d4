# tensorwire: two commands do all the set-up on a fresh Debian machine (root):
#   make demo   install what is needed, build, run a two-process tensor write
#   make test   install what is needed, build, run the C++ and Python tests (and 5 s of each fuzz target)
#   make fuzz   build the libFuzzer targets (clang) and run each for FUZZ_SECONDS (default 60)
#   make test-system-ucx   the build against the system's UCX (Debian's libucx-dev, 1.13), its tests (part of test)
#   make lint   ruff (lint, format check), mypy, clang-format's check (the first step of test); make format applies
# Variables: PYTHON (default python3), TENSORWIRE_UCX=wheel|system (default wheel).

PYTHON ?= python3
TENSORWIRE_UCX ?= wheel
export TENSORWIRE_UCX
BUILD_CPP := build/cpp
BUILD_FUZZ := build/fuzz
BUILD_SYSTEM := build/cpp-system
FUZZ_SECONDS ?= 60
FUZZ_TEST_SECONDS ?= 5
FUZZ_TARGETS := region control hello record frame
# clang, and compiler-rt for libFuzzer (only recommended by clang, so named).
FUZZ_APT_PACKAGES := clang libclang-rt-dev
APT_PACKAGES := g++ pkg-config libgtest-dev iproute2 ccache $(FUZZ_APT_PACKAGES)
# ccache: the tests' tree (build/cpp) and the package's (pip's) compile the core with the same
# flags, so the second build takes the first's objects; CMake reads the launcher from here.
# ccache keys on the compiler's name too: both trees name g++ (pip's would, CMake's would say c++).
export CMAKE_C_COMPILER_LAUNCHER := ccache
export CMAKE_CXX_COMPILER_LAUNCHER := ccache
ifeq ($(origin CC),default)
CC := gcc
endif
ifeq ($(origin CXX),default)
CXX := g++
endif
export CC CXX
# The UCX wheel only for the build that links it (TENSORWIRE_UCX=wheel).
PIP_BUILD_DEPS := "scikit-build-core>=0.11.2" "nanobind>=2.4" $(if $(filter wheel,$(TENSORWIRE_UCX)),"libucx-cu13>=1.22") \
	"cmake>=3.20" ninja numpy
# expecttest: torch.testing's test suite needs it (tests/python/pytorch/test_torch_conformance.py, make conformance).
PIP_TEST_DEPS := pytest pytest-timeout pytest-xdist grpcio matplotlib "mypy==2.4.1" "torch==2.13.0" expecttest "ruff==0.17.6" \
	"clang-format==23.1.3"
STAMP := build/.stamp

.PHONY: all deps deps-mpi build demo test test-cpp test-python test-fuzz test-system-ucx fuzz fuzz-build fuzz-seeds \
	fuzz-merge bench-compare conformance stubs clean help lint format

all: build

help:
	@sed -n '1,8p' Makefile

# System packages (only those missing), then the Python build and test tools.
$(STAMP)/deps: Makefile
	@mkdir -p $(STAMP)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	$(if $(filter system,$(TENSORWIRE_UCX)),@dpkg -s libucx-dev >/dev/null 2>&1 || apt-get install -y -qq libucx-dev)
	$(PYTHON) -m pip install -q $(PIP_BUILD_DEPS) $(PIP_TEST_DEPS)
	@touch $@

deps: $(STAMP)/deps

# Optional: Open MPI + mpi4py for `tensorwire bench alltoall|allreduce --compare mpi`
# (make test does not need them; the MPI tests skip without).
deps-mpi: deps
	@dpkg -s openmpi-bin libopenmpi-dev >/dev/null 2>&1 || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev)
	$(PYTHON) -m pip install -q mpi4py
	$(PYTHON) -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"

# Editable install of the package (C++ core + nanobind extension).
build: deps
	$(PYTHON) -m pip install -q --no-build-isolation -e .

demo: build
	$(PYTHON) -m tensorwire demo

# The C++ tests run in 17 shards, a process each (CMakeLists.txt: a process that loads UCX
# costs 0.4 s), two at a time: 52 s here (one process per test: 170 s).
test-cpp: deps
	cmake -S . -B $(BUILD_CPP) -G Ninja -DTENSORWIRE_BUILD_TESTS=ON -DTENSORWIRE_BUILD_PYTHON=OFF \
	  -DTENSORWIRE_UCX=$(TENSORWIRE_UCX) -DPython_EXECUTABLE=$$(command -v $(PYTHON))
	cmake --build $(BUILD_CPP) -j2
	cd $(BUILD_CPP) && ctest --output-on-failure --timeout 300 -j2

# The Python tests mostly wait (process start-up, UCX, peers): PYTEST_WORKERS of them at a
# time (default: the CPU count, at least 2, at most 4) take 380 s instead of 700 s here (with
# tests/python/conftest.py's 1 ms UCX patch grace; 450 s without).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 2 ] && n=2; [ $$n -gt 4 ] && n=4; echo $$n)
test-python: build
	$(PYTHON) -m pytest tests/python -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=15

# The lint lane: seconds, so it goes first (a lint error fails CI before the long tests start).
# mypy: the package as pyproject.toml's [tool.mypy] says, then the README's examples as a
# user's program, `--strict` against the package's stubs (tests/typing/readme_examples.py).
# clang-format: .clang-format's style on every C++ file git knows (clang-format from PyPI, pinned:
# versions format differently).
CXX_SOURCES = $$(git ls-files '*.cc' '*.h' | grep -v '^tests/fuzz/corpus/')
CLANG_FORMAT = $$($(PYTHON) -c "import clang_format; print(clang_format.get_executable('clang-format'))")
lint: deps
	$(PYTHON) -m ruff check python tests
	$(PYTHON) -m ruff format --check python tests
	$(PYTHON) -m mypy
	MYPYPATH=python $(PYTHON) -m mypy --strict --follow-imports=silent tests/typing/readme_examples.py
	$(CLANG_FORMAT) --dry-run -Werror $(CXX_SOURCES)

format: deps
	$(PYTHON) -m ruff format python tests
	$(CLANG_FORMAT) -i $(CXX_SOURCES)

test: lint test-cpp test-python test-fuzz test-system-ucx

# The build against the system's UCX (issue 19 §6): Debian's libucx-dev (UCX 1.13,
# the oldest supported) or UCX_ROOT's, in its own tree: the C++ tests, then a Python
# smoke in its own venv, the package from the source tree with this tree's module.
# The main (editable) install is not touched. Its tcp RMA is slow: the tests stay small. No torch
# backend there (the smoke does not load it; its compile against torch's headers is the tree's longest).
SYSTEM_SMOKE := tests/python/core/test_system_ucx.py tests/python/core/test_device.py
test-system-ucx: deps
	@dpkg -s libucx-dev >/dev/null 2>&1 || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx-dev)
	cmake -S . -B $(BUILD_SYSTEM) -G Ninja -DTENSORWIRE_BUILD_TESTS=ON -DTENSORWIRE_UCX=system \
	  -DTENSORWIRE_BUILD_TORCH=OFF -DPython_EXECUTABLE=$$(command -v $(PYTHON))
	cmake --build $(BUILD_SYSTEM) -j2
	cd $(BUILD_SYSTEM) && ctest --output-on-failure --timeout 120 -j2
	@test -f $(BUILD_SYSTEM)/venv/.ready || { rm -rf $(BUILD_SYSTEM)/venv && \
	  { $(PYTHON) -m venv $(BUILD_SYSTEM)/venv || { rm -rf $(BUILD_SYSTEM)/venv && \
	    apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(BUILD_SYSTEM)/venv; }; } && \
	  $(BUILD_SYSTEM)/venv/bin/pip install -q numpy pytest pytest-timeout && touch $(BUILD_SYSTEM)/venv/.ready; }
	rm -rf $(BUILD_SYSTEM)/py && mkdir -p $(BUILD_SYSTEM)/py/tensorwire
	for f in $(CURDIR)/python/tensorwire/*; do case $$f in *.so) ;; *) ln -s $$f $(BUILD_SYSTEM)/py/tensorwire/;; esac; done
	cp $(BUILD_SYSTEM)/_core*.so $(BUILD_SYSTEM)/py/tensorwire/
	PYTHONPATH=$(CURDIR)/$(BUILD_SYSTEM)/py $(BUILD_SYSTEM)/venv/bin/python -m pytest $(SYSTEM_SMOKE) -q -p no:cacheprovider

# libFuzzer targets, one per wire format (tests/fuzz, docs/contracts.md §9.6), in their
# own clang + ASan/UBSan tree. The package check also covers a deps stamp made before
# clang was needed.
fuzz-build: deps
	@dpkg -s $(FUZZ_APT_PACKAGES) >/dev/null 2>&1 || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(FUZZ_APT_PACKAGES))
	CC=clang CXX=clang++ cmake -S . -B $(BUILD_FUZZ) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTENSORWIRE_BUILD_FUZZ=ON -DTENSORWIRE_BUILD_PYTHON=OFF -DTENSORWIRE_UCX=$(TENSORWIRE_UCX) \
	  -DPython_EXECUTABLE=$$(command -v $(PYTHON))
	cmake --build $(BUILD_FUZZ) --target tw_fuzz fuzz_make_seeds -j2

# Each target for FUZZ_SECONDS on a scratch copy of tests/fuzz/corpus/<target>; fails on
# any crash, sanitizer report, leak or limit (tests/fuzz/run.sh).
fuzz: fuzz-build
	bash tests/fuzz/run.sh $(BUILD_FUZZ) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

test-fuzz: fuzz-build
	bash tests/fuzz/run.sh $(BUILD_FUZZ) $(FUZZ_TEST_SECONDS) $(FUZZ_TARGETS)

# Rewrite the seed-* inputs from the real encoders (after a wire format changed).
fuzz-seeds: fuzz-build
	$(BUILD_FUZZ)/fuzz_make_seeds tests/fuzz/corpus

# Add to the committed corpus what the last `make fuzz` found that covers something new.
fuzz-merge: fuzz-build
	for t in $(FUZZ_TARGETS); do \
	  $(BUILD_FUZZ)/fuzz_$$t -merge=1 -max_len=4096 tests/fuzz/corpus/$$t $(BUILD_FUZZ)/corpus/$$t || exit 1; \
	done

# The performance comparison of the core issue (writes bench/results/).
bench-compare: build
	bash bench/compare_ucx_perftest.sh

# PyTorch's own distributed test suite (issue 48), as test/distributed/test_distributed_spawn.py runs it,
# 2 ranks, for each of CONFORMANCE_BACKENDS in turn (gloo first: the others list what gloo passed that
# they gated off or failed): bench/results/conformance_<backend>.txt and .json. Not part of `make test`
# (each of about 210 tests spawns 2 ranks: the files' totals give the time here). Exit status 1 when a
# test failed or hung. CONFORMANCE_ENV: KEY=VALUE settings for the test processes (none: exactly as
# PyTorch's runner). More options through CONFORMANCE_ARGS, e.g. CONFORMANCE_ARGS="-k all_gather".
CONFORMANCE_BACKENDS ?= gloo tensorwire
CONFORMANCE_ENV ?=
conformance: build
	@status=0; for b in $(CONFORMANCE_BACKENDS); do \
	  args="--backend $$b --out bench/results/conformance_$$b"; \
	  for e in $(CONFORMANCE_ENV); do args="$$args --env $$e"; done; \
	  [ $$b != gloo ] && [ -f bench/results/conformance_gloo.json ] && args="$$args --baseline bench/results/conformance_gloo.json"; \
	  echo "tensorwire conformance $$args $(CONFORMANCE_ARGS)"; \
	  $(PYTHON) -m tensorwire conformance $$args $(CONFORMANCE_ARGS) || status=1; \
	done; exit $$status

# The README's headline numbers re-measured (best of 3: about 28 minutes on the 2-vCPU VM; --repeat 1:
# about 11): `tensorwire bench report` reruns their benchmarks, rewrites their files in bench/results/
# and the README's blocks.
# Options through BENCH_ARGS: make bench BENCH_ARGS="--dry-run" (or "--only tensor-tcp,train-tcp").
.PHONY: bench
bench: build
	$(PYTHON) -m tensorwire bench report $(BENCH_ARGS)

# python/bindings/stubgen_patterns.txt: what the generator cannot see (Block's buffer protocol).
stubs: build
	$(PYTHON) -m nanobind.stubgen -m tensorwire._core -p python/bindings/stubgen_patterns.txt \
	  -o python/tensorwire/_core.pyi

clean:
	rm -rf build *.egg-info
