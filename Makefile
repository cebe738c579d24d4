# tensorwire: two commands do all the set-up on a fresh Debian machine (root):
#   make demo   install what is needed, build, run a two-process tensor write
#   make test   install what is needed, build, run the C++ and Python tests
# Variables: PYTHON (default python3), TENSORWIRE_UCX=wheel|system (default wheel).

PYTHON ?= python3
TENSORWIRE_UCX ?= wheel
export TENSORWIRE_UCX
BUILD_CPP := build/cpp
APT_PACKAGES := g++ pkg-config libgtest-dev iproute2
PIP_BUILD_DEPS := "scikit-build-core>=0.10" "nanobind>=2.4" "libucx-cu13>=1.22" "cmake>=3.20" ninja numpy
PIP_TEST_DEPS := pytest pytest-timeout grpcio matplotlib "torch==2.13.0"
STAMP := build/.stamp

.PHONY: all deps deps-mpi build demo test test-cpp test-python bench-compare stubs clean help

all: build

help:
	@sed -n '1,6p' Makefile

# System packages (only those missing), then the Python build and test tools.
$(STAMP)/deps:
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

test-cpp: deps
	cmake -S . -B $(BUILD_CPP) -G Ninja -DTENSORWIRE_BUILD_TESTS=ON -DTENSORWIRE_BUILD_PYTHON=OFF \
	  -DTENSORWIRE_UCX=$(TENSORWIRE_UCX) -DPython_EXECUTABLE=$$(command -v $(PYTHON))
	cmake --build $(BUILD_CPP) -j2
	cd $(BUILD_CPP) && ctest --output-on-failure --timeout 300

test-python: build
	$(PYTHON) -m pytest tests/python -q

test: test-cpp test-python

# The performance comparison of the core issue (writes bench/results/).
bench-compare: build
	bash bench/compare_ucx_perftest.sh

stubs: build
	$(PYTHON) -m nanobind.stubgen -m tensorwire._core -o python/tensorwire/_core.pyi

clean:
	rm -rf build *.egg-info
