"""Bootstrap of N ranks (tensorwire.ranks.world) and the launcher (tensorwire run):
the ranks meet in rank 0's control-plane store, or in an existing torch store
under torchrun; a missing rank, a rank claimed twice and sizes that differ fail
every rank, within the bound, with words that say which."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tensorwire import InvalidArgument
from tensorwire.ranks.launch import free_port as _free_port
from tensorwire.ranks.world import detect

SCRIPT = textwrap.dedent("""
    import os, sys, tensorwire.ranks.world as w
    with w.World(transport="tcp", timeout=20) as world:
        got = world.allgather({"rank": world.rank, "pid": os.getpid()})
        assert [g["rank"] for g in got] == list(range(world.size)), got
        assert world.broadcast("hello" if world.rank == world.size - 1 else None, root=world.size - 1) == "hello"
        # every ordered pair exchanges a few bytes one-sidedly through the address table
        import numpy as np
        buf = world.device.empty(world.size, "int32"); np.asarray(buf)[:] = -1
        world.device.publish("box", buf)
        world.barrier()
        src = world.device.empty(1, "int32"); np.asarray(src)[:] = world.rank
        for peer in range(world.size):
            if peer != world.rank:
                ch = world.channel(peer)
                ch.write(src, ch.lookup("box"), remote_offset=4 * world.rank).wait()
                ch.flush().wait()
        world.barrier()
        expect = [r if r != world.rank else -1 for r in range(world.size)]
        assert list(np.asarray(buf)) == expect, (list(np.asarray(buf)), expect)
        if int(sys.argv[1]) == world.rank:
            os._exit(7)   # dies mid-run: the launcher must name it
        world.barrier(timeout=60)
        assert "torch" not in sys.modules  # the control-plane store: a numpy program never loads torch
        print("rank", world.rank, "ok", flush=True)
""")


def _run(n, *script_args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", "run", "-n", str(n), "--", sys.executable, "-c", SCRIPT, *script_args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("n", [1, 3])
def test_world_bootstrap_collectives_and_one_sided(n):
    r = _run(n, "-1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ok") == n, r.stdout


def test_killed_rank_fails_run_naming_it():
    t0 = time.monotonic()
    r = _run(3, "2")
    assert r.returncode == 7, (r.returncode, r.stderr)
    assert "rank 2 exited with code 7" in r.stderr
    assert time.monotonic() - t0 < 30  # stopped promptly, not after the 60 s barrier timeout


BOOT = "import sys, tensorwire.ranks.world as w; w.World(transport='tcp', timeout=float(sys.argv[1]))"


def _ranks(envs: list[dict], timeouts: list[float], code: str = BOOT) -> list[tuple[int, str, float]]:
    """Starts one process per environment; (exit code, stderr, seconds it ran) of each."""
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(t)], env={**os.environ, **env}, stderr=subprocess.PIPE, text=True
        )
        for env, t in zip(envs, timeouts)
    ]
    out = []
    for p in procs:
        err = p.communicate(timeout=60)[1]
        out.append((p.returncode, err, time.monotonic() - t0))
    return out


def _env(rank: int, size: int, root: str) -> dict:
    return {"TENSORWIRE_RANK": str(rank), "TENSORWIRE_SIZE": str(size), "TENSORWIRE_ROOT": root}


def test_missing_rank_is_named_and_rank_0_failing_ends_the_others():
    """Rank 2 never comes: rank 0 gives up after its 2 s, naming it; rank 1 (whose own
    bound is 30 s) learns it from rank 0 at once, not at its own deadline."""
    root = f"127.0.0.1:{_free_port()}"
    (c0, e0, _), (c1, e1, t1) = _ranks([_env(0, 3, root), _env(1, 3, root)], [2, 30])
    assert c0 != 0 and c1 != 0
    assert "rank 2 did not join" in e0, e0
    # rank 1 reads rank 0's words in the store, or finds rank 0's device gone
    assert "rank 2 did not join" in e1 or "rank 0 ended the bootstrap" in e1, e1
    assert t1 < 20, t1


def test_sizes_that_differ_fail_every_rank():
    root = f"127.0.0.1:{_free_port()}"
    results = _ranks([_env(0, 2, root), _env(1, 3, root)], [20, 20])
    for code, err, took in results:
        assert code != 0 and "rank 1 says the world has 3 ranks, rank 0 says 2" in err, err
        assert took < 15, took


def test_two_processes_claiming_a_rank_fail_every_rank():
    """Two processes say they are rank 1 (rank 2 never comes, so nobody finishes first)."""
    root = f"127.0.0.1:{_free_port()}"
    results = _ranks([_env(0, 3, root), _env(1, 3, root), _env(1, 3, root)], [20, 20, 20])
    for code, err, took in results:
        assert code != 0 and "two processes claim rank 1" in err, err
        assert took < 15, took


TORCHRUN_SCRIPT = textwrap.dedent("""
    import sys, tensorwire.ranks.world as w
    from tensorwire.ranks.rendezvous import TorchStore
    with w.World(transport="tcp", timeout=20) as world:
        assert isinstance(world.store, TorchStore) and world.placement.store == "torch", world.store
        got = world.allgather(world.rank)
        assert got == list(range(world.size)), got
        world.barrier()
        print("rank", world.rank, "ok", flush=True)
""")


def test_world_under_torchrun_meets_in_its_store():
    """torchrun's agent hosts a TCPStore at MASTER_ADDR:MASTER_PORT: the ranks meet
    there (their addresses are in it afterwards), with no listener of their own."""
    torch = pytest.importorskip("torch")
    import datetime

    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False
    )
    env = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")} | env
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TORCHRUN_SCRIPT],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "ok" in out, out
    assert store.check([f"tensorwire/world/0/0/addr/{r}" for r in range(2)])


def test_world_meets_in_a_store_passed_in():
    """World(store=...) takes a c10d store (here an in-process HashStore; two ranks as threads)."""
    import threading

    from tensorwire.ranks.world import Placement, World

    torch = pytest.importorskip("torch")
    store = torch.distributed.HashStore()
    worlds, errors = [None, None], []

    def rank(r):
        try:
            worlds[r] = World(Placement(r, 2, "127.0.0.1:1", "test"), timeout=10, store=store, transport="tcp")
            worlds[r].got = worlds[r].allgather(r * 10)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {r}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert errors == [] and not any(t.is_alive() for t in threads)
        assert worlds[0].addresses == worlds[1].addresses == [w.device.address for w in worlds]
        assert worlds[0].got == worlds[1].got == [0, 10]
        assert store.check([f"{worlds[0].store_prefix}/addr/1"])
    finally:
        for w in worlds:
            if w is not None:
                w.close()


@pytest.mark.parametrize(
    "env, expect",
    [
        (
            {"TENSORWIRE_RANK": "2", "TENSORWIRE_SIZE": "4", "TENSORWIRE_ROOT": "10.0.0.1:5000"},
            (2, 4, "10.0.0.1:5000", "tensorwire run", "tensorwire"),
        ),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2, "127.0.0.1:29600", "mpirun", "tensorwire")),
        ({"PMI_RANK": "0", "PMI_SIZE": "3", "TENSORWIRE_ROOT": "h:1"}, (0, 3, "h:1", "pmi", "tensorwire")),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, (3, 8, "127.0.0.1:29600", "slurm", "tensorwire")),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"},
            (1, 2, "node0:29500", "torchrun", "torch"),
        ),  # torchrun's own store
        ({"RANK": "1", "WORLD_SIZE": "2", "TENSORWIRE_ROOT": "h:7"}, (1, 2, "h:7", "torchrun", "tensorwire")),
        ({}, (0, 1, "127.0.0.1:29600", "single", "tensorwire")),
    ],
)
def test_detect_launchers(env, expect):
    p = detect(env)
    assert (p.rank, p.size, p.root, p.launcher, p.store) == expect


@pytest.mark.parametrize(
    "env, words",
    [
        ({"TENSORWIRE_RANK": "4", "TENSORWIRE_SIZE": "4"}, "not a valid placement"),
        ({"TENSORWIRE_RANK": "x", "TENSORWIRE_SIZE": "4"}, "not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({"TENSORWIRE_RANK": "0", "TENSORWIRE_SIZE": "1", "TENSORWIRE_ROOT": "nohostport"}, "host:port"),
    ],
)
def test_detect_rejects_bad_environment(env, words):
    with pytest.raises(InvalidArgument, match=words):
        detect(env)


def test_run_needs_a_command():
    r = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "command" in r.stderr


def test_the_root_port_lies_below_the_kernels_ephemeral_range():
    # A root port from the ephemeral range can be handed to another rank's socket
    # before rank 0 binds it (CI lost a terasort run to that).
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    if low <= 20100:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = {_free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn, not one fixed port that a neighbour's run would also take


def test_run_gives_each_rank_torchruns_variables_beside_its_own():
    """`tensorwire run` sets what torch.distributed's env:// reads (as torchrun does), on a port that is
    not the root's, and World still meets at TENSORWIRE_ROOT (TENSORWIRE_RANK comes first)."""
    from tensorwire.ranks.launch import plan

    placements = plan(3)
    assert [p.env["RANK"] for p in placements] == ["0", "1", "2"]
    for p in placements:
        env = p.env
        assert env["RANK"] == env["TENSORWIRE_RANK"] and env["LOCAL_RANK"] == env["TENSORWIRE_LOCAL_RANK"]
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        root_port = env["TENSORWIRE_ROOT"].rsplit(":", 1)[1]
        assert env["MASTER_PORT"] != root_port and env["MASTER_PORT"] == placements[0].env["MASTER_PORT"]
        placement = detect(env)
        assert placement.launcher == "tensorwire run" and placement.root == env["TENSORWIRE_ROOT"]
