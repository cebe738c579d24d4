"""Bootstrap of N ranks (tensorwire.world) and the launcher (tensorwire run)."""

import subprocess
import sys
import textwrap
import time

import pytest

from tensorwire import InvalidArgument
from tensorwire.world import detect

SCRIPT = textwrap.dedent("""
    import os, sys, tensorwire.world as w
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
        print("rank", world.rank, "ok", flush=True)
""")


def _run(n, *script_args, timeout=60):
    return subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", str(n), "--",
                           sys.executable, "-c", SCRIPT, *script_args],
                          capture_output=True, text=True, timeout=timeout)


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


def test_missing_rank_is_named(free_port=None):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TENSORWIRE_RANK": "0", "TENSORWIRE_SIZE": "3", "TENSORWIRE_ROOT": f"127.0.0.1:{port}"}
    code = "import tensorwire.world as w; w.World(transport='tcp', timeout=2)"
    import os
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env, "TENSORWIRE_RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert "rank 2 did not join" in errs[0], errs[0]
    # rank 1 either times out itself (naming rank 2) or sees rank 0 end the bootstrap first
    assert "rank 2 did not join" in errs[1] or "rank 0 ended the bootstrap" in errs[1], errs[1]


@pytest.mark.parametrize("env, expect", [
    ({"TENSORWIRE_RANK": "2", "TENSORWIRE_SIZE": "4", "TENSORWIRE_ROOT": "10.0.0.1:5000"},
     (2, 4, "10.0.0.1:5000", "tensorwire run")),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2, "127.0.0.1:29600", "mpirun")),
    ({"PMI_RANK": "0", "PMI_SIZE": "3", "TENSORWIRE_ROOT": "h:1"}, (0, 3, "h:1", "pmi")),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, (3, 8, "127.0.0.1:29600", "slurm")),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"},
     (1, 2, "node0:29501", "torchrun")),
    ({}, (0, 1, "127.0.0.1:29600", "single")),
])
def test_detect_launchers(env, expect):
    p = detect(env)
    assert (p.rank, p.size, p.root, p.launcher) == expect


@pytest.mark.parametrize("env, words", [
    ({"TENSORWIRE_RANK": "4", "TENSORWIRE_SIZE": "4"}, "not a valid placement"),
    ({"TENSORWIRE_RANK": "x", "TENSORWIRE_SIZE": "4"}, "not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"TENSORWIRE_RANK": "0", "TENSORWIRE_SIZE": "1", "TENSORWIRE_ROOT": "nohostport"}, "host:port"),
])
def test_detect_rejects_bad_environment(env, words):
    with pytest.raises(InvalidArgument, match=words):
        detect(env)


def test_run_needs_a_command():
    r = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "command" in r.stderr
