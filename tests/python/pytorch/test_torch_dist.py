"""The "tensorwire" torch.distributed backend: every op x dtype x world size 1-4
against gloo's result (the same script on both backends), and the failure and
bad-input cases (docs/torch.md, "The torch.distributed backend")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import tensorwire_run, torchrun  # noqa: E402
from tensorwire.ranks.launch import free_port  # noqa: E402

HERE = Path(__file__).parent
OPS_SCRIPT = HERE / "_torch_dist_ops.py"


def load(out: Path, n: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


def same(a, b, key: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, key
        return
    assert not isinstance(a, str), f"{key}: tensorwire failed where gloo did not: {a}"
    assert a.dtype == b.dtype and a.shape == b.shape, key
    assert torch.equal(a, b), f"{key}: tensorwire {a.flatten()[:8]} != gloo {b.flatten()[:8]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,transport", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (2, "tcp")])
def test_every_op_and_dtype_matches_gloo(n: int, transport: str, tmp_path: Path) -> None:
    got = {}
    for backend in ("tensorwire", "gloo"):
        out = tmp_path / backend
        out.mkdir()
        run = tensorwire_run(n, OPS_SCRIPT, backend, str(out), env={"TENSORWIRE_TRANSPORT": transport})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        got[backend] = load(out, n)
    checked = 0
    for r in range(n):
        tw, gl = got["tensorwire"][r], got["gloo"][r]
        for key, want in gl.items():
            if isinstance(want, str):  # gloo does not do it: tensorwire either does it or says why
                # int16, which gloo moves not at all: against gloo's int32 result (the values are small)
                wide = gl.get(key.replace("/int16/", "/int32/"))
                if "/int16/" in key and wide is not None and not isinstance(wide, str):
                    same(tw[key], wide.to(torch.int16), f"rank {r} {key} (gloo's int32)")
                    checked += 1
                continue
            same(tw[key], want, f"rank {r} {key}")
            checked += 1
        for key, have in tw.items():
            if key.startswith("reduce_kept/") and r != n - 1:  # a non-root's tensor: left as it was
                assert have is not None and not isinstance(have, str) and bool(have), f"rank {r} {key}: {have}"
                checked += 1
        for key, have in tw.items():  # AVG: gloo has none; it is the sum over n
            if key.startswith("all_reduce/avg/"):
                total = gl[key.replace("/avg/", "/sum/")]
                if have is not None and not isinstance(have, str):
                    assert torch.allclose(have.float(), total.float() / n, rtol=1e-2), key
                    checked += 1
                else:
                    assert "floating point" in have, f"{key}: {have}"  # integer AVG: a clear refusal
    assert checked > 100 * n


SPARSE_SCRIPT = HERE / "_torch_sparse_ops.py"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3])
def test_sparse_all_reduce_matches_gloo(n: int, tmp_path: Path) -> None:
    """all_reduce of sparse COO tensors (SUM; 1 to 3 dimensions, dense dimensions, uncoalesced
    inputs, ranks without entries, 20k rows): the same indices, values and coalesced flag as gloo's;
    a MAX refused by both; a shape that differs between ranks refused on every rank, the group
    still usable after."""
    got = {}
    for backend in ("tensorwire", "gloo"):
        out = tmp_path / backend
        out.mkdir()
        run = tensorwire_run(n, SPARSE_SCRIPT, backend, str(out))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        got[backend] = load(out, n)
    for r in range(n):
        tw, gl = got["tensorwire"][r], got["gloo"][r]
        assert [k for k, v in gl.items() if isinstance(v, str)] == ["max_refused"], gl
        for key, want in gl.items():
            have = tw[key]
            if isinstance(want, str):
                assert isinstance(have, str) and "ValueError" in have, f"rank {r} {key}: {have} (gloo: {want})"
                continue
            assert not isinstance(have, str), f"rank {r} {key}: tensorwire failed where gloo did not: {have}"
            (ti, tv, tc, ts, tt), (gi, gv, gc, gs, gt) = have, want
            assert (tc, ts, tt) == (gc, gs, gt) and tc, f"rank {r} {key}: {(tc, ts, tt)} != gloo's {(gc, gs, gt)}"
            assert torch.equal(ti, gi) and torch.equal(tv, gv), (
                f"rank {r} {key}: {ti[:, :4]} {tv[:4]} != gloo's {gi[:, :4]} {gv[:4]}"
            )
        assert gl["sum/large"][0].shape[1] > 20_000  # the ranks' rows overlap only in part
        err = tw["shape_mismatch"]
        assert isinstance(err, str) and "ValueError" in err and "rank 0: torch.float32[10, 4]" in err, err
        assert torch.equal(tw["after_mismatch"], torch.full((3,), float(n)))


def script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "prog.py"
    # say(): one write(2) per line, so that the ranks' lines never interleave on the shared pipe
    p.write_text(
        "import os, sys, time, datetime\nimport torch, torch.distributed as dist\nimport tensorwire.torch\n"
        "def say(*parts):\n    os.write(1, (' '.join(map(str, parts)) + '\\n').encode())\n" + textwrap.dedent(body)
    )
    return p


@pytest.mark.timeout(120)
def test_killed_rank_fails_the_others_pending_ops_naming_it(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=90))
        r = dist.get_rank()
        dist.barrier()
        if r == 1:
            os.kill(os.getpid(), 9)
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(100_000), 1)
        except dist.DistBackendError as e:
            say(f"RAISED after {time.monotonic() - t0:.1f} s: {e}")
            os._exit(0)
        say("NO ERROR")
    """,
    )
    run = torchrun(2, prog, timeout=110)
    out = run.stdout
    assert "RAISED" in out, out + run.stderr[-2000:]
    line = next(x for x in out.splitlines() if "RAISED" in x)
    assert "rank 1" in line, line
    assert float(line.split()[2]) < 30, line  # the Device's liveness bound, not the 90 s op timeout


@pytest.mark.timeout(120)
def test_bad_input_is_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=30))
        r = dist.get_rank()
        def expect(what, fn, *words):
            try:
                fn()
            except Exception as e:
                assert all(w in str(e) for w in words), (what, str(e))
                say("OK", what, type(e).__name__)
                return
            say("NO ERROR", what)
        for count in (10, 100_000):  # a receive into a smaller tensor fails naming both sizes
            if r == 0:
                try:  # (an eager send is complete once posted; a placed one fails too)
                    dist.send(torch.ones(count), 1)
                except Exception as e:
                    assert str(4 * count) in str(e) and str(2 * count) in str(e), str(e)
            else:
                t = torch.zeros(count // 2)
                expect(f"recv {count}", lambda: dist.recv(t, 0), str(4 * count), str(2 * count))
                assert torch.count_nonzero(t) == 0  # nothing landed
        expect("reduce op", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND), "not supported")
        expect("avg of integers", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG),
               "floating point")
        expect("root", lambda: dist.broadcast(torch.ones(4), src=5), "")
        x = torch.ones(8 if r == 0 else 16)
        expect("shape mismatch", lambda: dist.all_reduce(x), "rank")
        # the group is still usable after the refused calls
        t = torch.full((70_000,), float(r))
        if r == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
            assert t[0] == 0 and t[-1] == 0
        y = torch.ones(4, 4).t()  # not contiguous: copied in and out
        dist.all_reduce(y)
        assert bool((y == 2).all())
        say("STILL OK")
        # a peer that never takes part: the op ends within the group's timeout
        be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        be._set_default_timeout(datetime.timedelta(seconds=3))
        t0 = time.monotonic()
        if r == 0:
            expect("timeout", lambda: dist.recv(torch.ones(100_000), 1, tag=5), "did not complete within 3 s")
            say(f"TIMEOUT after {time.monotonic() - t0:.1f} s")
        time.sleep(4)
        dist.destroy_process_group()
        say("DESTROYED", r)
    """,
    )
    run = tensorwire_run(2, prog, timeout=110)
    out = run.stdout
    assert "NO ERROR" not in out, out
    for what in ("recv 10", "recv 100000", "reduce op", "avg of integers", "root", "timeout", "STILL OK"):
        assert what in out, out + run.stderr[-3000:]
    assert out.count("OK shape mismatch") == 2, out
    line = next(x for x in out.splitlines() if x.startswith("TIMEOUT"))
    assert float(line.split()[2]) < 10, line
    assert out.count("DESTROYED") == 2, out + run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_subgroups_mixed_spec_and_explicit_store(tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, n, r == 0)
        dist.init_process_group("cpu:tensorwire,cuda:gloo", store=store, rank=r, world_size=n)
        sub = dist.new_group([0, 2], backend="tensorwire")
        t = torch.full((1000,), float(r + 1))
        if r in (0, 2):
            dist.all_reduce(t, group=sub)
            assert t[0] == 4.0, t[0]
            if r == 0:
                dist.send(torch.arange(50_000.), 2, group=sub)
            else:
                u = torch.empty(50_000); dist.recv(u, 0, group=sub); assert torch.equal(u, torch.arange(50_000.))
        w = torch.full((3,), float(r))
        dist.all_reduce(w)
        assert w[0] == 3.0
        say("SUBGROUP OK", dist.get_backend())
        dist.destroy_process_group()
    """,
    )
    run = tensorwire_run(3, prog, timeout=110)
    assert run.stdout.count("SUBGROUP OK") == 3, run.stdout + run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_async_collectives_run_in_order_beside_the_caller(tmp_path: Path) -> None:
    """async_op collectives run in call order on the group's comm thread (the caller goes on:
    DDP's backward overlaps its all_reduce so): results and futures equal the sync ones; a rank
    that waits in a p2p receive while its own async all_reduce is still queued is not stuck
    (the peer finishes that all_reduce before it sends); a failing async op raises at wait()."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=30))
        r = dist.get_rank()
        ts = [torch.full((300_000,), float(r + k)) for k in range(6)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        fut = works[-1].get_future()
        dist.barrier()  # queued after them: runs once they ran
        assert all(w.is_completed() for w in works)
        for k, (t, w) in enumerate(zip(ts, works)):
            w.wait()
            assert torch.all(t == 2 * k + 1), k
        assert torch.all(fut.wait()[0] == 11)
        say("ORDER OK", r)
        # rank 0 queues an all_reduce and then blocks in a receive; rank 1 sends only after
        # its all_reduce completed, which needs rank 0's comm thread to run it
        big = torch.ones(4_000_000)
        w = dist.all_reduce(big, async_op=True)
        if r == 0:
            got = torch.zeros(10)
            dist.recv(got, 1)
            w.wait()
            say("NOT STUCK", bool(torch.all(got == 7)), bool(torch.all(big == 2)))
        else:
            w.wait()
            dist.send(torch.full((10,), 7.0), 0)
        bad = torch.ones(8 if r == 0 else 16)
        w = dist.all_reduce(bad, async_op=True)
        try:
            w.wait()
            say("NO ERROR")
        except Exception as e:
            say("ASYNC ERROR", r, type(e).__name__, "rank" in str(e))
        dist.barrier()
        dist.destroy_process_group()
        say("CLOSED", r)
    """,
    )
    run = tensorwire_run(2, prog, timeout=110)
    out = run.stdout
    assert out.count("ORDER OK") == 2, out + run.stderr[-3000:]
    assert "NOT STUCK True True" in out, out + run.stderr[-3000:]
    assert "NO ERROR" not in out and out.count("ASYNC ERROR") == 2 and "False" not in out, out
    assert out.count("CLOSED") == 2, out + run.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_large_messages_land_whole_whoever_posts_first(transport: str, tmp_path: Path) -> None:
    """Placed messages of odd sizes, sent before and after the receive is posted, the same
    tensors twice (the second time registered). A receive of the wrong size fails on both
    sides, naming both sizes; the next message of the pair still arrives."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=60))
        r = dist.get_rank()
        sizes = [300_001, 1_000_003, 4_194_305]
        srcs = [torch.arange(s, dtype=torch.int64) * (k + 2) for k, s in enumerate(sizes)]
        for late in (False, True):  # late: the receives are posted after every RTS has arrived
            if r == 0:  # the same tensors twice: the second time they are registered (split, not pulled)
                works = [dist.isend(t, 1, tag=k) for k, t in enumerate(srcs)]
                for w in works:
                    w.wait()
            else:
                if late:
                    time.sleep(0.5)
                bufs = [torch.zeros(s, dtype=torch.int64) for s in sizes]
                for w in [dist.irecv(b, 0, tag=k) for k, b in enumerate(bufs)]:
                    w.wait()
                for k, (b, s) in enumerate(zip(bufs, sizes)):
                    assert torch.equal(b, torch.arange(s, dtype=torch.int64) * (k + 2)), (late, k)
            say("ORDER OK", r, late)
        try:  # the receiver expects fewer bytes than are sent
            if r == 0:
                dist.send(torch.ones(1_000_000, dtype=torch.int64), 1, tag=5)
            else:
                dist.recv(torch.zeros(999_999, dtype=torch.int64), 0, tag=5)
        except Exception as e:
            say("REFUSED", r, "8000000" in str(e) and "7999992" in str(e))
        if r == 0:
            dist.send(torch.full((500_000,), 3, dtype=torch.int64), 1, tag=6)
        else:
            t = torch.zeros(500_000, dtype=torch.int64)
            dist.recv(t, 0, tag=6)
            say("NEXT OK", bool((t == 3).all()))
    """,
    )
    run = tensorwire_run(2, prog, timeout=110, env={"TENSORWIRE_TRANSPORT": transport})
    out = run.stdout
    assert out.count("ORDER OK") == 4, out + run.stderr[-3000:]
    assert "REFUSED 0 True" in out and "REFUSED 1 True" in out, out + run.stderr[-3000:]
    assert "NEXT OK True" in out, out + run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_many_outstanding_messages_past_the_credit_window_over_tcp(tmp_path: Path) -> None:
    """100 isends (eager and placed) against 100 irecvs, 20 rounds, over tcp: both rings run out
    of credit, so the placed sends' DONE records wait in the queue while both ranks wait. A wait
    that watched those completed writes returned at once and never drove the worker; the peer's
    writes did not land and both ranks spun until the op timeout (CI, stop 38)."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=40))
        r = dist.get_rank()
        for it in range(20):
            if r == 0:
                works = [dist.isend(torch.full((k % 3 * 20_000 + 1,), k, dtype=torch.int64), 1, tag=9)
                         for k in range(100)]
            else:
                bufs = [torch.empty(k % 3 * 20_000 + 1, dtype=torch.int64) for k in range(100)]
                works = [dist.irecv(b, 0, tag=9) for b in bufs]
            for w in works:
                w.wait()
            if r == 1:
                assert [int(b[0]) for b in bufs] == list(range(100)), it
        dist.barrier()
        say("ROUNDS OK", r)
    """,
    )
    run = tensorwire_run(2, prog, timeout=110, env={"TENSORWIRE_TRANSPORT": "tcp"})
    assert run.stdout.count("ROUNDS OK") == 2, run.stdout + run.stderr[-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_send_moves_while_its_sender_waits_in_a_collective(transport: str, tmp_path: Path) -> None:
    """isend, then a collective, then the send's wait (legal torch: gloo moves the send in the
    background). The send's record waits for credit (150 eager sends) or for the receiver's RTR
    (a placed send): only the sender's progress moves it, so every wait of the group (barrier,
    all_reduce, broadcast) drives the messages engine too. Before, the sender sat in the collective
    while its receiver waited for the send, and neither came back until the op timeout."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=30))
        r = dist.get_rank()
        def coll(name):
            if name == "barrier":
                dist.barrier()
            elif name == "all_reduce":
                dist.all_reduce(torch.ones(4))
            else:
                dist.broadcast(torch.ones(3), src=1)
        big = 5 << 18  # floats: 5 MiB, a placed send (its RTR needs the sender's progress)
        sizes = [2] * 150 + [big]  # eager past the credit window (64 records), then placed
        for name in ("barrier", "all_reduce", "broadcast", "barrier"):
            if r == 0:
                works = [dist.isend(torch.full((s,), float(k)), 1, tag=3) for k, s in enumerate(sizes)]
                coll(name)
                for w in works:
                    w.wait()
            else:
                bufs = [torch.empty(s) for s in sizes]
                for k, b in enumerate(bufs):  # before the collective: the sender is in it by now
                    dist.recv(b, 0, tag=3)
                    assert int(b[0]) == k and int(b[-1]) == k, (name, k)
                coll(name)
            say("AFTER", name, r)
        dist.destroy_process_group()
    """,
    )
    t0 = time.monotonic()
    run = tensorwire_run(2, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": transport})
    assert run.stdout.count("AFTER") == 8, run.stdout + run.stderr[-3000:]
    assert time.monotonic() - t0 < 100, "the ranks waited for an op timeout"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_messages_sent_before_their_sender_left_are_received(transport: str, tmp_path: Path) -> None:
    """Rank 0 sends 60 eager messages and leaves; rank 1 receives them after it left. Consuming
    the 32nd hands credit back to the sender, a write to a peer that is gone: it failed the
    receive of a message that had arrived whole (bench torch-dist's dispatch series, whose
    rank 0 leaves first)."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=30))
        r = dist.get_rank()
        if r == 0:
            for k in range(60):
                dist.send(torch.full((2,), float(k)), 1)
            dist.destroy_process_group()
            say("LEFT")
            os._exit(0)
        time.sleep(2)  # rank 0 is gone by now
        got = []
        for k in range(60):
            t = torch.empty(2)
            dist.recv(t, 0)
            got.append(int(t[0]))
        assert got == list(range(60)), got
        say("RECEIVED", len(got))
        os._exit(0)
    """,
    )
    # torchrun: its agent hosts the c10d store, which outlives rank 0 (under plain env://, as under
    # `tensorwire run`, rank 0 hosts it, and a rank 0 that left before rank 1 read its keys took it along)
    run = torchrun(2, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": transport})
    assert "LEFT" in run.stdout and "RECEIVED 60" in run.stdout, run.stdout + run.stderr[-3000:]


def _both_pass_a_barrier(prog: Path) -> None:
    """Runs `prog` as 2 ranks by env:// without torchrun (rank 0 hosts the c10d store, as
    torchrun's agent would otherwise); both must exit 0 and rank 1 say "BARRIER OK 1"."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(prog)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(
                os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE="2"
            ),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and "BARRIER OK 1" in outs[1][0], outs


@pytest.mark.timeout(120)
def test_rank_0_does_not_take_the_store_away_before_the_last_barrier_is_read(tmp_path: Path) -> None:
    """Rank 0 hosts the c10d store (env:// without an agent) and leaves right after a
    barrier (destroy_process_group, then exit: bench torch-dist's rank program); rank 1,
    late (1 s), must still pass its barrier and leave cleanly."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=30))
        r = dist.get_rank()
        if r == 1:
            time.sleep(1.0)
        dist.barrier()
        say("BARRIER OK", r)
        dist.destroy_process_group()
        os._exit(0)
    """,
    )
    _both_pass_a_barrier(prog)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,transport", [(2, "tcp"), (3, "shm")])
def test_large_all_reduce_matches(n: int, transport: str, tmp_path: Path) -> None:
    """all_reduce of tensors of about 10 MB a rank's block, blocks of uneven length: exact
    results (small integers) for sum, avg, max and bfloat16, each tensor reduced twice."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=60))
        r, n = dist.get_rank(), dist.get_world_size()
        pg = dist.distributed_c10d._get_default_group()
        count = n * 2_500_001 + 2  # about 10 MB a chunk of float32: two rounds, the last chunk shorter
        base = torch.arange(count) % 7
        for dt, op in ((torch.float32, dist.ReduceOp.SUM), (torch.float32, dist.ReduceOp.AVG),
                       (torch.int64, dist.ReduceOp.MAX), (torch.bfloat16, dist.ReduceOp.SUM)):
            t = (base + r).to(dt)
            want = {dist.ReduceOp.SUM: base * n + n * (n - 1) // 2, dist.ReduceOp.MAX: base + n - 1,
                    dist.ReduceOp.AVG: (base * n + n * (n - 1) // 2).double() / n}[op].to(dt)
            for _ in range(2):
                t.copy_((base + r).to(dt))
                dist.all_reduce(t, op=op)
                assert torch.equal(t, want), (dt, op, t[:9], want[:9])
        say("EXACT", r)
        dist.destroy_process_group()
    """,
    )
    run = tensorwire_run(n, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": transport})
    assert run.stdout.count("EXACT") == n, run.stdout + run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_killed_rank_fails_a_large_all_reduce_naming_it(tmp_path: Path) -> None:
    """A rank killed between two large all_reduces: the others' next one raises, naming it,
    within the Device's liveness bound, not the op timeout."""
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=90))
        r = dist.get_rank()
        t = torch.ones(3 << 20)  # 12 MiB
        dist.all_reduce(t)
        t.fill_(1)
        dist.all_reduce(t)
        assert float(t[0]) == 3
        dist.barrier()
        if r == 2:
            os.kill(os.getpid(), 9)
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
        except dist.DistBackendError as e:
            say(f"RAISED after {time.monotonic() - t0:.1f} s: {e}")
            os._exit(0)
        say("NO ERROR")
    """,
    )
    run = torchrun(3, prog, timeout=110, env={"TENSORWIRE_TRANSPORT": "shm"})
    lines = [x for x in run.stdout.splitlines() if "RAISED" in x]
    assert len(lines) == 2, run.stdout + run.stderr[-2000:]
    for line in lines:
        assert "rank 2" in line, line
        assert float(line.split()[2]) < 30, line  # the Device's liveness bound, not the 90 s op timeout
