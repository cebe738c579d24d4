"""Every environment variable tensorwire reads or sets, in one table.

docs/configuration.md mirrors VARIABLES and UCX_VARIABLES (tests/python/
test_configuration.py checks that the two agree and that no Python file reads
a TENSORWIRE_* variable missing here); `tensorwire info` shows each with the
value in force. Regenerate the document's tables with
`python -m tensorwire.config`.

All of tensorwire's own variables are TENSORWIRE_*: the TW_* names of
earlier versions are no longer read (world.detect() warns once when it sees
one of the launcher's).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Variable:
    name: str
    meaning: str
    values: str
    default: str
    reader: str  # who reads it (or sets it, for the launcher's)


CORE = "C++ core (every Device)"
WORLD = "tensorwire.ranks.world (World, detect)"
RUN = "set by `tensorwire run`; read by tensorwire.ranks.world"
BENCH = "benches"
TESTBED = "set by the testbed for commands in a host"

VARIABLES: tuple[Variable, ...] = (
    # -- C++ core: read when a Device is made (a bad value fails there) --
    Variable(
        "TENSORWIRE_PROGRESS",
        "progress mode of every Device's data workers (overrides Device(progress=))",
        "blocking, polling, inline",
        "Device(progress=...), blocking",
        CORE,
    ),
    Variable(
        "TENSORWIRE_TRANSPORT",
        "transport of the torch.distributed backend's Devices (`Device(transport=...)`)",
        "auto, tcp, shm, rdma",
        "auto (UCX_TLS as set)",
        "the torch backend (tensorwire._c10d)",
    ),
    Variable(
        "TENSORWIRE_SPIN_US",
        "how long a waiter polls before it sleeps on the event fd (overrides Device(spin_us=))",
        "0..1000000 (microseconds)",
        "Device(spin_us=...), 100",
        CORE,
    ),
    Variable(
        "TENSORWIRE_LANE_FORM",
        "how lanes move data: one-sided RMA or active messages (a comma list: lane i takes item i mod n)",
        "auto, rma, messages, or a comma list of them",
        "auto (messages where UCX emulates RMA, e.g. tcp; rma elsewhere)",
        CORE,
    ),
    Variable(
        "TENSORWIRE_PLACE",
        "which tensors a Device's slots ask their senders to place on a "
        "message-form lane (tcp): put into the slot's buffer (a dynamic slot: a block it offered), then a "
        "header message (contracts §12); others travel in their message",
        "LO-HI (bytes, inclusive), off",
        "262144-67108864 with inline progress (262144-4194304 where the kernel's tcp congestion control is bbr), "
        "off with a progress thread",
        CORE,
    ),
    Variable(
        "TENSORWIRE_EXACT_EXPORT",
        "give remote peers keys of a registration of exactly the exported range (instead of its pool slab's)",
        "0, 1",
        "1 when UCX offers verbs RC/DC/UD or SRD (hardware keys), else 0",
        CORE,
    ),
    Variable(
        "TENSORWIRE_MAP_SHARED_MEMORY",
        "map same-host peers' pool slabs for the direct path (memcpy instead of UCX)",
        "0 off, anything else on",
        "Device(map_shared_memory=...), on",
        CORE,
    ),
    Variable(
        "TENSORWIRE_STREAMING_COPY_MIN",
        "smallest copy that uses streaming (non-temporal) stores",
        "bytes; 0 = never",
        "half the last-level cache + 1",
        CORE,
    ),
    Variable(
        "TENSORWIRE_REP_MOVSB_MIN",
        "smallest copy below the streaming size that uses `rep movsb` "
        "(x86-64 CPUs with ERMS; glibc's memcpy uses vector loops from the L2's size on AMD)",
        "bytes; 0 = never",
        "65536",
        CORE,
    ),
    Variable(
        "TENSORWIRE_SHARED_COPY_MIN",
        "smallest static-slot tensor (up to 2 MiB) whose copy a receiver "
        "waiting in recv() shares with its sender over shared memory (contracts §10.3)",
        "bytes; 0 = never",
        "262144",
        CORE,
    ),
    Variable("TENSORWIRE_LOG", "level of the core's log lines on stderr", "error, warn, info, debug", "warn", CORE),
    Variable(
        "TENSORWIRE_COLL_SMALL_BYTES",
        "largest all_reduce of the C++ collectives layer that takes "
        "recursive doubling (above: the ring; docs/collectives.md); read when a Collectives is made "
        "(`bench allreduce --threshold` sets it)",
        "bytes",
        "65536",
        CORE,
    ),
    Variable(
        "TENSORWIRE_NO_F16C",
        "set: the reductions convert float16 without the CPU's F16C instructions (a check of one against the other)",
        "set or unset",
        "unset",
        CORE,
    ),
    # -- the world of ranks (tensorwire run, World) --
    Variable(
        "TENSORWIRE_RANK",
        "this process's rank",
        "0..SIZE-1",
        "unset: OMPI/PMI/Slurm/torchrun variables, else a single rank",
        RUN,
    ),
    Variable("TENSORWIRE_SIZE", "number of ranks", "integer >= 1", "as TENSORWIRE_RANK", RUN),
    Variable(
        "TENSORWIRE_LOCAL_RANK",
        "rank among those on the same host (for the rank's own program)",
        "integer >= 0",
        "unset",
        "set by `tensorwire run`",
    ),
    Variable(
        "TENSORWIRE_ROOT",
        "address rank 0's device listens on, known to every rank: it serves the store "
        "the ranks meet in (tensorwire.ranks.rendezvous)",
        "host:port",
        "127.0.0.1:29600; under torchrun unset: the ranks meet in torchrun's store (MASTER_ADDR:MASTER_PORT)",
        RUN,
    ),
    Variable(
        "TENSORWIRE_HOST",
        "address this process's device listens on",
        "host or IP",
        "127.0.0.1 when the root is loopback, else the local address that routes to it",
        "tensorwire.ranks.world, the torch backend, tensorwire train (PS roles); set by `tensorwire run --testbed`",
    ),
    Variable(
        "TENSORWIRE_TOKEN",
        "shared secret of a World's devices: peers with another token are refused",
        "any string",
        "empty (no token)",
        WORLD + ", the torch backend",
    ),
    # -- benches --
    Variable(
        "TENSORWIRE_COLL_TEST_RANKS",
        "ranks of the C++ loopback test that times the two all_reduce algorithms (docs/collectives.md)",
        "2..",
        "2",
        "tests/cpp (a disabled test)",
    ),
    Variable(
        "TENSORWIRE_CONFORMANCE_CLAIM",
        "features the plugin backend claims in PyTorch's suite",
        "comma list",
        "set by `tensorwire conformance`",
        "its test processes",
    ),
    Variable(
        "TENSORWIRE_CONFORMANCE_IMPORT",
        "modules imported first (the one that registers the backend)",
        "comma list",
        "set by `tensorwire conformance`",
        "its test processes",
    ),
    Variable(
        "TENSORWIRE_CONFORMANCE_TIMEOUT",
        "seconds a test of the suite may take",
        "seconds",
        "set by `tensorwire conformance`",
        "its test processes",
    ),
    Variable(
        "TENSORWIRE_CONFORMANCE_GATES",
        "backend name the suite's gates see (--gates)",
        "a name or empty",
        "set by `tensorwire conformance`",
        "its test processes",
    ),
    Variable(
        "TENSORWIRE_CONFORMANCE_START",
        "how a test of the suite starts its ranks (--start)",
        "spawn, forkserver",
        "set by `tensorwire conformance`",
        "its test processes",
    ),
    Variable(
        "TENSORWIRE_PROGRESS_BAR",
        "draw the benches' progress bar on stderr (how ranks and spawned processes learn --progress/--no-progress)",
        "0, 1",
        "1 when stderr is a terminal",
        BENCH + ", tensorwire train; set by --progress/--no-progress and by `tensorwire run`",
    ),
    Variable(
        "TENSORWIRE_BENCH_SPIN_US",
        "spin of the bandwidth benches' devices (Device(spin_us=)); a "
        "client hands its own to the `bench serve` it spawns",
        "microseconds",
        "100",
        BENCH,
    ),
    Variable(
        "TENSORWIRE_TERASORT_DEBUG",
        "print each shuffle piece's arrival time",
        "non-empty = on",
        "off",
        "bench terasort",
    ),
    # -- testbed --
    Variable(
        "TENSORWIRE_TESTBED", "name of the testbed that commands use", "a name", "tw", "tensorwire testbed; " + TESTBED
    ),
    Variable(
        "TENSORWIRE_TESTBED_HOST",
        "testbed host this command runs in (a rank's host name)",
        "a host name",
        "unset: the machine's host name",
        "tensorwire.ranks.world; " + TESTBED,
    ),
    Variable("TENSORWIRE_TESTBED_ADDR", "address of that testbed host", "IP", "unset", TESTBED),
    # -- build --
    Variable(
        "TENSORWIRE_UCX",
        "which UCX the build links (Makefile, pip via pyproject.toml, CMake)",
        "wheel, system",
        "wheel",
        "build time only",
    ),
    Variable(
        "TENSORWIRE_BUILD_TORCH",
        "whether the build makes the torch.distributed backend (tensorwire._c10d) "
        "against the building Python's torch (pip via pyproject.toml, CMake)",
        "AUTO, ON, OFF",
        "AUTO (when torch imports)",
        "build time only",
    ),
)

_BY_NAME = {v.name: v for v in VARIABLES}
NAMES = frozenset(_BY_NAME)


@dataclass(frozen=True)
class UcxVariable:
    name: str
    what_tensorwire_does: str


UCX_VARIABLES: tuple[UcxVariable, ...] = (
    UcxVariable(
        "UCX_TLS",
        "respected with transport auto (unset: every transport but tcp, `^tcp`; a tcp in it "
        "opts back into UCX's tcp, which a peer's packets can use to reach any memory of the process: "
        "only between trusted hosts); transport tcp (UCX keeps `self`), shm or rdma replaces it; the "
        "control plane and tcp lanes are tensorwire's own sockets (contracts §11)",
    ),
    UcxVariable(
        "UCX_NET_DEVICES", "respected; unset and a device bound to loopback: lo (Device(net_devices=) overrides both)"
    ),
    UcxVariable(
        "UCX_TCP_SNDBUF, UCX_TCP_RCVBUF",
        "UCX's tcp only (a user's UCX_TLS): tensorwire's sockets leave "
        "the buffers to the kernel's autotuning (fixed 4M ones were slower with UCX's tcp, "
        "bench/results/tcp_tuning.md)",
    ),
    UcxVariable("UCX_CMA_BW", "4000MBps unless set (memcpy into mapped slabs beats process_vm_writev)"),
    UcxVariable("UCX_RNDV_SCHEME, UCX_RNDV_THRESH", "put_zcopy and 32K on hosts without RDMA devices, unless set"),
    UcxVariable(
        "(tcp keepalive)",
        "the control plane and tcp lanes are tensorwire's own sockets: probes every Device(keepalive=), 1 s",
    ),
    UcxVariable("UCX_ROOT", "build time: prefix of a system UCX (TENSORWIRE_UCX=system)"),
    UcxVariable("other UCX_*", "UCX's own (e.g. UCX_LOG_LEVEL): apply to every context"),
)


def variable(name: str) -> Variable:
    """The table's entry for `name` (KeyError names the unknown variable)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a tensorwire environment variable (tensorwire.config.VARIABLES)") from None


def effective(env: Mapping[str, str] | None = None) -> list[dict[str, str | bool]]:
    """Every variable with the value in force: the environment's, else its default."""
    env = os.environ if env is None else env
    return [
        {"name": v.name, "value": env[v.name] if v.name in env else v.default, "set": v.name in env} for v in VARIABLES
    ]


# ---- the progress bar switch: --progress/--no-progress -> TENSORWIRE_PROGRESS_BAR ----

PROGRESS_BAR = "TENSORWIRE_PROGRESS_BAR"


def progress_bar(choice: bool | None = None) -> bool:
    """Whether to draw the progress bar: the command's --progress/--no-progress, else
    TENSORWIRE_PROGRESS_BAR (what a parent command chose), else whether stderr is a terminal."""
    if choice is not None:
        return choice
    value = os.environ.get(PROGRESS_BAR)
    if value in ("0", "1"):
        return value == "1"
    return sys.stderr.isatty()


def export_progress_bar(choice: bool | None = None) -> bool:
    """progress_bar(choice), written to TENSORWIRE_PROGRESS_BAR so that the ranks and
    processes this command starts draw (or not) the same way. Returns it."""
    on = progress_bar(choice)
    os.environ[PROGRESS_BAR] = "1" if on else "0"
    return on


# ---- docs/configuration.md ----


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_tables() -> str:
    """The two tables of docs/configuration.md, as they appear there."""
    lines = ["| Variable | Meaning | Values | Default | Read by |", "|---|---|---|---|---|"]
    lines += [
        f"| `{v.name}` | {_cell(v.meaning)} | {_cell(v.values)} | {_cell(v.default)} | {_cell(v.reader)} |"
        for v in VARIABLES
    ]
    lines += ["", "| UCX variable | What tensorwire does with it |", "|---|---|"]
    lines += [f"| `{u.name}` | {_cell(u.what_tensorwire_does)} |" for u in UCX_VARIABLES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_tables())
