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

from conftest import torchrun  # noqa: E402
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
        run = torchrun(n, OPS_SCRIPT, backend, str(out), env={"TENSORWIRE_TRANSPORT": transport})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        got[backend] = load(out, n)
    checked = 0
    for r in range(n):
        tw, gl = got["tensorwire"][r], got["gloo"][r]
        for key, want in gl.items():
            if isinstance(want, str):  # gloo does not do it: tensorwire either does it or says why
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


def script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "prog.py"
    # say(): one write(2) per line, so that the ranks' lines never interleave on the shared pipe
    p.write_text("import os, sys, time, datetime\nimport torch, torch.distributed as dist\nimport tensorwire.torch\n"
                 "def say(*parts):\n    os.write(1, (' '.join(map(str, parts)) + '\\n').encode())\n"
                 + textwrap.dedent(body))
    return p


@pytest.mark.timeout(120)
def test_killed_rank_fails_the_others_pending_ops_naming_it(tmp_path: Path) -> None:
    prog = script(tmp_path, """
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
    """)
    run = torchrun(2, prog, timeout=110)
    out = run.stdout
    assert "RAISED" in out, out + run.stderr[-2000:]
    line = next(x for x in out.splitlines() if "RAISED" in x)
    assert "rank 1" in line, line
    assert float(line.split()[2]) < 30, line  # the Device's liveness bound, not the 90 s op timeout


@pytest.mark.timeout(120)
def test_bad_input_is_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    prog = script(tmp_path, """
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
        for count in (10, 100_000):  # a receive into a smaller tensor fails; a placed send fails too
            if r == 0 and count == 10:
                dist.send(torch.ones(count), 1)  # eager: complete once posted (the receiver refuses it)
            elif r == 0:
                expect(f"send {count}", lambda: dist.send(torch.ones(count), 1), "same size")
            else:
                t = torch.zeros(count // 2)
                expect(f"recv {count}", lambda: dist.recv(t, 0), "same size")
                assert torch.count_nonzero(t) == 0  # nothing landed
        expect("reduce op", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND), "not supported")
        expect("non-contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t()), "contiguous")
        expect("any source", lambda: dist.recv(torch.ones(4)), "source")
        x = torch.ones(8 if r == 0 else 16)
        expect("shape mismatch", lambda: dist.all_reduce(x), "rank")
        # the group is still usable for p2p after the refused calls
        t = torch.full((70_000,), float(r))
        if r == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
            assert t[0] == 0 and t[-1] == 0
        say("P2P OK")
        # a peer that never takes part: the op ends within the group's timeout
        pg = dist.distributed_c10d._get_default_group()
        pg.timeout = 3.0
        t0 = time.monotonic()
        if r == 0:
            expect("timeout", lambda: dist.send(torch.ones(100_000), 1, tag=5), "did not complete within 3 s")
            say(f"TIMEOUT after {time.monotonic() - t0:.1f} s")
        time.sleep(4)
        regs = len(pg.registry)
        dist.destroy_process_group()
        say(f"REGISTRATIONS {regs} -> {len(pg.registry)}")
    """)
    run = torchrun(2, prog, timeout=110)
    out = run.stdout
    assert "NO ERROR" not in out, out
    for what in ("recv 10", "send 100000", "recv 100000", "reduce op", "non-contiguous", "any source",
                 "timeout", "P2P OK"):
        assert what in out, out + run.stderr[-3000:]
    assert out.count("OK shape mismatch") == 2, out
    line = next(x for x in out.splitlines() if x.startswith("TIMEOUT"))
    assert float(line.split()[2]) < 10, line
    regs = [x for x in out.splitlines() if x.startswith("REGISTRATIONS")]
    # a receiver registers its placed destinations (a sender's tensors up to 4 MiB are pulled from its
    # outbox, unregistered): some were held, and destruction released every one
    assert len(regs) == 2 and all(x.endswith("-> 0") for x in regs), regs
    assert sum(int(x.split()[1]) for x in regs) > 0, regs


@pytest.mark.timeout(120)
def test_subgroups_mixed_spec_and_explicit_store(tmp_path: Path) -> None:
    prog = script(tmp_path, """
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
    """)
    run = torchrun(3, prog, timeout=110)
    assert run.stdout.count("SUBGROUP OK") == 3, run.stdout + run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_peer_sending_malformed_records_is_refused_and_named(tmp_path: Path) -> None:
    """Rank 1 runs modified code: it writes records no tensorwire peer writes (each case in a group
    of its own). Rank 0's receive from it fails naming it, nothing lands, and rank 0's other
    groups go on."""
    prog = script(tmp_path, """
        import numpy as np
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=60))
        eight = np.zeros(8, np.uint8)  # a payload: (address, length)
        payload = (eight.ctypes.data, eight.size)
        r = dist.get_rank()
        for case in ("kind", "length", "ticket", "flood"):
            g = dist.new_group([0, 1], backend="tensorwire")
            m = g.msg
            dist.barrier(group=g)
            if r == 1:
                if case == "kind":
                    m._post(0, 99, 0, 1, 100, 0, 0, 0)
                elif case == "length":  # an eager record that says 100 B but carries 8
                    m._post(0, 1, 0, 1, 100, 0, *payload)
                elif case == "ticket":  # a ready-to-receive record that says it carries a share ticket
                    from tensorwire.ranks.messages import RTR, SHARED
                    m._post(0, RTR, 0, 1, 1 << 20, 0, *payload, SHARED)
                else:  # more unmatched messages than a receiver keeps (posted within credit)
                    for i in range(20000):
                        t0 = time.monotonic()
                        while m.sent[0] + 1 - m._credit(0) > 64 and time.monotonic() - t0 < 2:
                            m.progress()
                            time.sleep(0.0002)
                        if m.sent[0] + 1 - m._credit(0) > 64:
                            break  # no more credit: rank 0 stopped reading (it refused us)
                        m._post(0, 1, 7, i + 1, 8, 0, *payload)
                say("SENT", case)
            else:
                t = torch.zeros(25)
                t0 = time.monotonic()
                try:
                    if case == "flood":  # nothing is posted here: rank 1's messages pile up unmatched
                        while time.monotonic() - t0 < 30 and 1 not in m.failed:
                            m.progress()
                            time.sleep(0.001)
                        raise m.failed[1]
                    dist.recv(t, 1, group=g)
                    say("NO ERROR", case)
                except Exception as e:
                    say(f"REFUSED {case} after {time.monotonic() - t0:.1f} s:", e)
                assert torch.count_nonzero(t) == 0
            x = torch.ones(4)
            dist.all_reduce(x)  # the default group is untouched
            assert x[0] == 2
        say("ALIVE", r)
        os._exit(0)
    """)
    run = torchrun(2, prog, timeout=110)
    out = run.stdout
    assert "NO ERROR" not in out, out
    for case, words in (("kind", "malformed record (kind 99"), ("length", "malformed record (kind 1, 100 B, payload 8 B)"),
                        ("ticket", "a share ticket of 8 B"), ("flood", "more than 16384 messages")):
        line = next((x for x in out.splitlines() if x.startswith(f"REFUSED {case}")), None)
        assert line is not None, out + run.stderr[-3000:]
        assert "rank 1 sent" in line and words in line, line
    assert out.count("ALIVE") == 2, out + run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_async_collectives_run_in_order_beside_the_caller(tmp_path: Path) -> None:
    """async_op collectives run in call order on the group's comm thread (the caller goes on:
    DDP's backward overlaps its all_reduce so): results and futures equal the sync ones; a rank
    that waits in a p2p receive while its own async all_reduce is still queued is not stuck
    (the peer finishes that all_reduce before it sends); a failing async op raises at wait()."""
    prog = script(tmp_path, """
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
    """)
    run = torchrun(2, prog, timeout=110)
    out = run.stdout
    assert out.count("ORDER OK") == 2, out + run.stderr[-3000:]
    assert "NOT STUCK True True" in out, out + run.stderr[-3000:]
    assert "NO ERROR" not in out and out.count("ASYNC ERROR") == 2 and "False" not in out, out
    assert out.count("CLOSED") == 2, out + run.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_large_messages_land_whole_whoever_posts_first(transport: str, tmp_path: Path) -> None:
    """Placed messages of odd sizes, sent before and after the receive is posted: a tensor not
    registered yet (up to 4 MiB) is copied to the sender's outbox and pulled by the receiver; a
    registered one over shm is split (the sender's RTS carries its descriptor, the receiver
    reads the second half, or claims the first too, and says TAKEN); over tcp the sender writes. A receive of the wrong size
    fails on both sides, naming both sizes; the next message of the pair still arrives."""
    prog = script(tmp_path, """
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
        m = dist.distributed_c10d._get_default_group().msg
        say("SPLIT", r, m.split_sends)
        say("PULLED", r, m.pulled_sends)
    """)
    run = torchrun(2, prog, timeout=110, env={"TENSORWIRE_TRANSPORT": transport})
    out = run.stdout
    assert out.count("ORDER OK") == 4, out + run.stderr[-3000:]
    assert "REFUSED 0 True" in out and "REFUSED 1 True" in out, out + run.stderr[-3000:]
    assert "NEXT OK True" in out, out + run.stderr[-3000:]
    split = "SPLIT 0 0" not in out  # the sender counts its split sends
    assert split == (transport == "shm"), out
    assert "PULLED 0 0" not in out, out  # a tensor not registered yet, up to 4 MiB: the receiver pulls it


@pytest.mark.timeout(120)
def test_split_messages_copy_through_the_peers_shares(tmp_path: Path) -> None:
    """Tensors past the pull size sent again from and into the same allocations over shm are
    shared in place (tensorwire.sharing): the receiver copies its half out of the sender's share
    and a sender that finds the receiver's ready-to-receive record copies its half into the
    receiver's share, the bytes outside the whole pages through UCX; every byte lands, whoever
    posts first, and a slice of a larger allocation or a share_memory_() tensor is never shared (the
    latter refused once, then not examined again). A share the cache drops while
    a receive that sent its ticket waits keeps its pages until that receive completes."""
    prog = script(tmp_path, """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=60))
        r = dist.get_rank()
        count = (5 << 20) // 8 + 3  # past the 4 MiB pull size: registered and split
        src, dst = torch.zeros(count, dtype=torch.int64), torch.zeros(count, dtype=torch.int64)
        big = torch.zeros(2 * count, dtype=torch.int64)
        part = big[7: 7 + count]  # a slice: its allocation has bytes the op does not cover
        ready = torch.zeros(1)
        for it in range(5):
            for buf in (dst, part):
                if r == 0:
                    src.copy_(torch.arange(count) * (it + 3) + (buf is part))
                    if it % 2:  # the receive is posted first: its RTR (and share) waits for us
                        dist.recv(ready, 1)
                    dist.send(src, 1)
                else:
                    w = dist.irecv(buf, 0)
                    if it % 2:
                        dist.send(ready, 0)
                    w.wait()
                    assert torch.equal(buf, torch.arange(count) * (it + 3) + (buf is part)), (it, buf is part)
        assert float(big[:7].sum()) == 0 and float(big[7 + count:].sum()) == 0
        shm = torch.zeros(count, dtype=torch.int64).share_memory_()  # shared already: never shared in place
        for it in range(3):
            if r == 0:
                dist.send(torch.full((count,), it, dtype=torch.int64), 1)
            else:
                dist.recv(shm, 0)
                assert bool((shm == it).all()), it
        if r == 1:
            say("REFUSED ONCE", dist.distributed_c10d._get_default_group().msg.met.get(
                (shm.untyped_storage().data_ptr(), shm.untyped_storage().nbytes())))
        m = dist.distributed_c10d._get_default_group().msg
        shared = {(s.ptr, s.nbytes) for s, _keep in m.shares.entries.values()}
        say("MAPPED", r, m.mapped_copies > 0, "SLICE", (big.untyped_storage().data_ptr(), big.nbytes) in shared)
        # a cache that holds one share: receives in flight keep theirs until they complete
        m.shares.max_bytes = 6 << 20
        bufs = [torch.zeros(count, dtype=torch.int64) for _ in range(4)]
        for it in range(2):  # the second time each buffer is shared, dropping the one before
            if r == 0:
                dist.recv(ready, 1)
                for k in range(4):
                    src.copy_(torch.arange(count) * (k + 11) + it)
                    dist.send(src, 1)
            else:
                works = [dist.irecv(b, 0) for b in bufs]
                say("DEFERRED", len(m.release_due)) if it else None
                dist.send(ready, 0)
                for w in works:
                    w.wait()
                for k, b in enumerate(bufs):
                    assert torch.equal(b, torch.arange(count) * (k + 11) + it), (it, k)
        say("SETTLED", r, len(m.release_due), len(m.share_users))
        dist.destroy_process_group()
    """)
    run = torchrun(2, prog, timeout=110, env={"TENSORWIRE_TRANSPORT": "shm"})
    out = run.stdout + run.stderr[-3000:]
    assert run.returncode == 0, out
    assert "MAPPED 0 True SLICE False" in run.stdout and "MAPPED 1 True SLICE False" in run.stdout, out
    assert "REFUSED ONCE False" in run.stdout, out  # a share_memory_() tensor: refused, then not looked at again
    assert "DEFERRED 3" in run.stdout, out  # three shares dropped from the cache while their receives waited
    assert "SETTLED 0 0 0" in run.stdout and "SETTLED 1 0 0" in run.stdout, out


@pytest.mark.timeout(120)
def test_many_outstanding_messages_past_the_credit_window_over_tcp(tmp_path: Path) -> None:
    """100 isends (eager and placed) against 100 irecvs, 20 rounds, over tcp: both rings run out
    of credit, so the placed sends' DONE records wait in the queue while both ranks wait. A wait
    that watched those completed writes returned at once and never drove the worker; the peer's
    writes did not land and both ranks spun until the op timeout (CI, stop 38)."""
    prog = script(tmp_path, """
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
    """)
    run = torchrun(2, prog, timeout=110, env={"TENSORWIRE_TRANSPORT": "tcp"})
    assert run.stdout.count("ROUNDS OK") == 2, run.stdout + run.stderr[-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_send_moves_while_its_sender_waits_in_a_collective(transport: str, tmp_path: Path) -> None:
    """isend, then a collective, then the send's wait (legal torch: gloo moves the send in the
    background). The send's record waits for credit (150 eager sends) or for the receiver's RTR
    (a placed send): only the sender's progress moves it, so every wait of the group (barrier,
    all_reduce, broadcast) drives the messages engine too. Before, the sender sat in the collective
    while its receiver waited for the send, and neither came back until the op timeout."""
    prog = script(tmp_path, """
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
    """)
    t0 = time.monotonic()
    run = torchrun(2, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": transport})
    assert run.stdout.count("AFTER") == 8, run.stdout + run.stderr[-3000:]
    assert time.monotonic() - t0 < 100, "the ranks waited for an op timeout"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_messages_sent_before_their_sender_left_are_received(transport: str, tmp_path: Path) -> None:
    """Rank 0 sends 60 eager messages and leaves; rank 1 receives them after it left. Consuming
    the 32nd hands credit back to the sender, a write to a peer that is gone: it failed the
    receive of a message that had arrived whole (bench torch-dist's dispatch series, whose
    rank 0 leaves first)."""
    prog = script(tmp_path, """
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
    """)
    run = torchrun(2, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": transport})
    assert "LEFT" in run.stdout and "RECEIVED 60" in run.stdout, run.stdout + run.stderr[-3000:]


def _both_pass_a_barrier(prog: Path) -> None:
    """Runs `prog` as 2 ranks by env:// without torchrun (rank 0 hosts the c10d store, as
    torchrun's agent would otherwise); both must exit 0 and rank 1 say "BARRIER OK 1"."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(prog)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, LOCAL_WORLD_SIZE="2"))
             for r in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and "BARRIER OK 1" in outs[1][0], outs


@pytest.mark.timeout(120)
def test_a_barrier_returns_when_the_store_goes_after_every_rank_arrived(tmp_path: Path) -> None:
    """A barrier before any collective meets in the c10d store, which rank 0 hosts. Rank 0 reads
    every rank's arrival and leaves; rank 1, the last reader, then tidies the round's keys in a
    store that is gone. The barrier is over (every arrival was read): it returned an error
    instead (bench torch-dist's dispatch series, whose rank 0 leaves first)."""
    prog = script(tmp_path, """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=30))
        r = dist.get_rank()
        read = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank1-read-every-value")
        if r == 1:  # the last reader, late: rank 0 and its store are gone by then
            store = dist.distributed_c10d._get_default_group().world.store
            real_add = store.add
            def late_add(key, n):  # called once every value is read
                open(read, "w").close()
                time.sleep(1.5)
                return real_add(key, n)
            store.add = late_add
        dist.barrier()
        if r == 0:  # leave (and take the store) once rank 1 read every value, before it tidies
            deadline = time.monotonic() + 60
            while not os.path.exists(read) and time.monotonic() < deadline:
                time.sleep(0.01)
        say("BARRIER OK", r)
        os._exit(0)
    """)
    _both_pass_a_barrier(prog)


@pytest.mark.timeout(120)
def test_rank_0_does_not_take_the_store_away_before_the_last_barrier_is_read(tmp_path: Path) -> None:
    """Rank 0 hosts the c10d store (env:// without an agent) and leaves right after a
    store barrier (destroy_process_group, then exit: bench torch-dist's rank program). A rank
    still reading that barrier's values must get them: destroy_process_group on rank 0 waits,
    bounded, until the last reader is done. Rank 1 reads late here (1 s)."""
    prog = script(tmp_path, """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=30))
        r = dist.get_rank()
        if r == 1:  # reads the barrier's values late: rank 0 is through it by then
            store = dist.distributed_c10d._get_default_group().world.store
            real_get = store._get
            def late_get(key):
                time.sleep(1.0)
                store._get = real_get
                return real_get(key)
            store._get = late_get
        dist.barrier()
        say("BARRIER OK", r)
        dist.destroy_process_group()
        os._exit(0)
    """)
    _both_pass_a_barrier(prog)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,transport", [(2, "tcp")])
def test_large_all_reduce_through_mapped_memory_matches(n: int, transport: str, tmp_path: Path) -> None:
    """all_reduce of tensors larger than a round's piece (8 MiB per chunk), chunks of uneven
    length: over tcp by messages; exact results (small integers) for sum, avg, max and bfloat16.
    (Over shared memory the first all_reduce of each tensor in
    test_all_reduce_in_the_ranks_own_tensors_shared_in_place takes the ranks' mapped landing areas.)"""
    prog = script(tmp_path, """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=60))
        r, n = dist.get_rank(), dist.get_world_size()
        pg = dist.distributed_c10d._get_default_group()
        count = n * 2_500_001 + 2  # about 10 MB a chunk of float32: two rounds, the last chunk shorter
        base = torch.arange(count) % 7
        for dt, op in ((torch.float32, dist.ReduceOp.SUM), (torch.float32, dist.ReduceOp.AVG),
                       (torch.int64, dist.ReduceOp.MAX), (torch.bfloat16, dist.ReduceOp.SUM)):
            t = (base + r).to(dt)
            dist.all_reduce(t, op=op)
            want = {dist.ReduceOp.SUM: base * n + n * (n - 1) // 2, dist.ReduceOp.MAX: base + n - 1,
                    dist.ReduceOp.AVG: (base * n + n * (n - 1) // 2).double() / n}[op].to(dt)
            assert torch.equal(t, want), (dt, op, t[:9], want[:9])
        say("SHARED", bool(pg._shared), r)
        dist.destroy_process_group()
    """)
    run = torchrun(n, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": transport})
    shared = transport == "shm"
    assert run.stdout.count(f"SHARED {shared}") == n, run.stdout + run.stderr[-3000:]


@pytest.mark.timeout(150)
def test_all_reduce_in_the_ranks_own_tensors_shared_in_place(tmp_path: Path) -> None:
    """The first all_reduce of a tensor goes through the ranks' mapped landing areas (pg._shared;
    several rounds of pieces, chunks of uneven length); a tensor all-reduced again is shared in
    place (tensorwire.sharing) and reduced in the ranks' own tensors: exact results for sum, avg,
    max and bfloat16 with odd lengths (the elements outside the whole pages go through the engine), a slice of a larger allocation left out of it (the
    rest of its allocation stays private), a size that differs between ranks refused on every rank,
    a group made under TENSORWIRE_SHARE_IN_PLACE=0 shares nothing, and after the groups are destroyed
    every shared allocation is private memory again."""
    prog = script(tmp_path, """
        from tensorwire import sharing
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=60))
        r, n = dist.get_rank(), dist.get_world_size()
        pg = dist.distributed_c10d._get_default_group()
        count = n * 2_500_001 + 5  # about 10 MB a chunk of float32: several landing-area rounds
        base = torch.arange(count) % 7
        kept = []
        for dt, op in ((torch.float32, dist.ReduceOp.SUM), (torch.float32, dist.ReduceOp.AVG),
                       (torch.int64, dist.ReduceOp.MAX), (torch.bfloat16, dist.ReduceOp.SUM)):
            t = (base + r).to(dt)
            want = {dist.ReduceOp.SUM: base * n + n * (n - 1) // 2, dist.ReduceOp.MAX: base + n - 1,
                    dist.ReduceOp.AVG: (base * n + n * (n - 1) // 2).double() / n}[op].to(dt)
            for again in range(3):  # the first through the landing areas; the second shares it; the third reuses
                t.copy_((base + r).to(dt))
                dist.all_reduce(t, op=op)
                assert torch.equal(t, want), (dt, op, again, t[:9], want[:9])
            kept.append(t)
        say("IN_PLACE", pg._in_place, len(pg.msg.shares), bool(pg._shared), r)
        import warnings
        with warnings.catch_warnings():  # the engine's (small) all_reduce: IEEE overflow, as torch, no warning
            warnings.simplefilter("error")
            huge = torch.full((8,), 3e38)
            dist.all_reduce(huge)
            assert bool(torch.isinf(huge).all())
        big = torch.full((3 << 20,), 2.0)
        part = big[1000: 1000 + (2 << 20)]
        for _ in range(3):
            part.fill_(1.0)
            dist.all_reduce(part)
        assert float(part.sum()) == n * (2 << 20) and float(big[:1000].sum()) == 2000
        say("SLICE", pg.msg.shares.cached((big.untyped_storage().data_ptr(), big.untyped_storage().nbytes())), r)
        odd = torch.ones(count + (r == 1))
        try:
            dist.all_reduce(odd)
            say("NO ERROR", r)
        except ValueError as e:
            say("REFUSED", r, e)
        ranges = [sharing.interior(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in kept]
        os.environ["TENSORWIRE_SHARE_IN_PLACE"] = "0"  # read by each new group's engine
        off = dist.new_group(backend="tensorwire")
        t = torch.ones(count)
        for _ in range(3):
            t.fill_(1.0)
            dist.all_reduce(t, group=off)
        assert bool((t == n).all())
        say("OFF", len(off.msg.shares), off._in_place, r)
        dist.destroy_process_group()
        say("PRIVATE", all(sharing.private_anonymous(lo, hi) for lo, hi in ranges), r)
    """)
    run = torchrun(3, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": "shm"})
    out = run.stdout + run.stderr[-3000:]
    assert run.returncode == 0, out
    for r in range(3):
        assert f"IN_PLACE True 4 True {r}" in run.stdout, out
        assert f"SLICE None {r}" in run.stdout, out
        assert f"PRIVATE True {r}" in run.stdout, out
        assert f"OFF 0 None {r}" in run.stdout, out  # TENSORWIRE_SHARE_IN_PLACE=0: nothing shared
    refused = [x for x in run.stdout.splitlines() if x.startswith("REFUSED")]
    assert len(refused) == 3 and all("all_reduce of" in x and "rank" in x for x in refused), out


@pytest.mark.timeout(120)
def test_killed_rank_fails_a_large_all_reduce_naming_it(tmp_path: Path) -> None:
    """A rank killed between two all_reduces through the mapped landing areas: the others' next
    one raises, naming it, within the Device's liveness bound (their writes into its area land
    in memory nobody reads; the token round is what notices)."""
    prog = script(tmp_path, """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=90))
        r = dist.get_rank()
        t = torch.ones(3 << 20)  # 12 MiB: the landing areas' path, then (again) shared in place
        dist.all_reduce(t)
        t.fill_(1)
        dist.all_reduce(t)
        pg = dist.distributed_c10d._get_default_group()
        assert bool(pg._shared) and pg._in_place and float(t[0]) == 3
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
    """)
    run = torchrun(3, prog, timeout=110, env={"TENSORWIRE_TRANSPORT": "shm"})
    lines = [x for x in run.stdout.splitlines() if "RAISED" in x]
    assert len(lines) == 2, run.stdout + run.stderr[-2000:]
    for line in lines:
        assert "rank 2" in line, line
        assert float(line.split()[2]) < 30, line  # the Device's liveness bound, not the 90 s op timeout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_tensor_sent_again_over_tcp_is_written_in_place(transport: str, tmp_path: Path) -> None:
    """A 1 MiB tensor not registered yet is copied into the sender's outbox and pulled by the
    receiver. Over tcp one sent again from the same allocation is registered and written in
    place from then on (pulled once of three sends); over shared memory every send is pulled."""
    prog = script(tmp_path, """
        dist.init_process_group("tensorwire", timeout=datetime.timedelta(seconds=60))
        r = dist.get_rank()
        t = torch.zeros(1 << 18)  # 1 MiB of float32, one allocation for every send
        for k in range(3):
            if r == 0:
                t.fill_(k + 1)
                dist.send(t, 1)
            else:
                dist.recv(t, 0)
                assert float(t[0]) == k + 1 and float(t[-1]) == k + 1, k
        if r == 0:
            say("PULLED", dist.distributed_c10d._get_default_group().msg.pulled_sends)
        dist.barrier()
        dist.destroy_process_group()
    """)
    run = torchrun(2, prog, timeout=140, env={"TENSORWIRE_TRANSPORT": transport})
    assert f"PULLED {1 if transport == 'tcp' else 3}" in run.stdout, run.stdout + run.stderr[-3000:]
