"""tensorwire.ranks.roles, the one launcher of local roles: a clean run returns every
role's result; the first failure is named (a death before the errors it
caused, in the role's own words where it gave them) and the rest are
stopped within a bound (SIGTERM, then SIGKILL after the grace)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tensorwire.ranks.roles import Roles, RoleError, describe_exit

# Spawned children start a fresh interpreter (~0.5 s, more on a busy machine):
# the bounds below leave room for that.
START_S = 20.0


def double(conn, x):
    conn.send(("result", 2 * x))


def die(conn, code, after):
    time.sleep(after)
    os._exit(code)


def hang(conn):
    time.sleep(120)


def stubborn(conn):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send(("ready",))
    time.sleep(120)


def report_error(conn, text, after):
    time.sleep(after)
    conn.send(("error", text, time.monotonic()))


def address_then_result(conn, rank):
    conn.send(("address", f"addr{rank}"))
    msg = conn.recv()
    conn.send(("result", (rank, msg[1])))


def echo(conn):
    while True:
        msg = conn.recv()
        if msg == "bye":
            return
        conn.send(("ok", msg))


def raise_in_thread(conn):
    raise ValueError("thread role broke")


def test_describe_exit():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(None) == "is still running"


def test_clean_run_returns_every_result():
    t0 = time.monotonic()
    with Roles() as roles:
        for i in range(3):
            roles.spawn(f"role {i}", double, i)
        roles.supervise(START_S)
    assert [r.result for r in roles] == [0, 2, 4]
    assert all(r.exitcode == 0 for r in roles)
    assert time.monotonic() - t0 < START_S


def test_threads_run_like_processes():
    with Roles() as roles:
        roles.thread("t0", double, 5)
        roles.thread("t1", raise_in_thread)
        with pytest.raises(RoleError) as err:
            roles.supervise(10)
    assert roles[0].result == 10
    assert err.value.first is roles[1] and roles[1].exitcode == 1
    assert "t1 exited with code 1" in str(err.value) and "thread role broke" in str(err.value)


def test_first_failure_named_and_the_rest_stopped_within_the_grace():
    t0 = time.monotonic()
    with Roles(grace=1.0) as roles:
        roles.spawn("hang 0", hang)
        roles.spawn("die 1", die, 7, 0.2)
        roles.spawn("hang 2", hang)
        with pytest.raises(RoleError) as err:
            roles.supervise(START_S)
        stopped_by = time.monotonic()
    e = err.value
    assert e.first is roles[1] and e.failed == [roles[1]]
    assert str(e).startswith("die 1 exited with code 7"), str(e)
    # the others: SIGTERM at once (linger 0), gone well within the grace
    assert roles[0].exitcode == -signal.SIGTERM and roles[2].exitcode == -signal.SIGTERM
    assert roles[0].failure() == "killed by the launcher after another role failed"
    assert stopped_by - t0 < START_S


def test_a_role_that_ignores_sigterm_is_killed_after_the_grace():
    with Roles(grace=0.5) as roles:
        r = roles.spawn("stubborn", stubborn)
        assert r.recv(START_S) == ("ready",)
        t0 = time.monotonic()
        roles.stop()
        took = time.monotonic() - t0
    assert r.exitcode == -signal.SIGKILL
    assert 0.4 < took < 5.0, took


def test_a_death_is_named_before_the_errors_it_caused():
    """Its peers report errors after it died: within the linger they are
    heard, and the death leads the message."""
    with Roles(grace=1.0) as roles:
        roles.spawn("peer 0", report_error, "peer 0: lost peer 1", 1.0)
        roles.spawn("peer 1", die, 17, 0.1)
        with pytest.raises(RoleError) as err:
            roles.supervise(START_S, linger=START_S)
    e = err.value
    assert e.first is roles[1] and [r.name for r in e.failed] == ["peer 1", "peer 0"]
    assert str(e) == "peer 1 exited with code 17 before its result; then peer 0: lost peer 1", str(e)


def test_the_earliest_reported_error_first():
    with Roles() as roles:
        roles.spawn("a", report_error, "late", 1.0)
        roles.spawn("b", report_error, "early", 0.1)
        with pytest.raises(RoleError) as err:
            roles.supervise(START_S, linger=START_S)
    assert err.value.first.name == "b" and str(err.value) == "b: early"


def test_timeout_stops_every_role():
    with Roles(grace=1.0) as roles:
        roles.spawn("slow", hang)
        with pytest.raises(RoleError) as err:
            roles.supervise(1.0)
    assert err.value.timed_out and err.value.first is None and "still running: slow" in str(err.value)
    assert roles[0].exitcode == -signal.SIGTERM


def test_gather_then_broadcast():
    with Roles() as roles:
        for i in range(2):
            roles.spawn(f"r{i}", address_then_result, i)
        got = [m[1] for m in roles.gather("address", START_S)]
        assert got == ["addr0", "addr1"]
        roles.broadcast(("addresses", got))
        roles.supervise(START_S)
    assert [r.result for r in roles] == [(0, got), (1, got)]


def test_gather_names_a_role_that_died_during_setup():
    with Roles() as roles:
        roles.spawn("r0", hang)
        roles.spawn("r1", die, 5, 0.0)
        with pytest.raises(RoleError, match="r1 exited with code 5 during setup"):
            roles.gather("address", START_S)


def test_recv_answers_then_names_the_exit():
    with Roles() as roles:
        r = roles.spawn("echo", echo)
        r.send("hi")
        assert r.recv(START_S) == ("ok", "hi")
        with pytest.raises(TimeoutError, match="echo did not answer within 0.2 s"):
            r.recv(0.2)
        r.send("bye")
        with pytest.raises(RoleError, match="echo exited with code 0"):
            r.recv(START_S)


def test_a_failed_command_is_named_with_its_last_stderr_lines():
    with Roles(grace=1.0) as roles:
        roles.command("sleeper", ["sh", "-c", "sleep 60 & sleep 60"], on_output=lambda *a: None)
        roles.command("bad", ["sh", "-c", "sleep 0.2; echo first >&2; echo last words >&2; exit 4"])
        with pytest.raises(RoleError) as err:
            roles.supervise(START_S, need_result=False)
    assert err.value.first.name == "bad"
    assert str(err.value).startswith("bad exited with code 4") and "last words" in str(err.value), str(err.value)
    assert roles[0].exitcode == -signal.SIGTERM  # its process group: the background sleep too


def test_a_clean_command_run_relays_whole_lines():
    out = []
    with Roles() as roles:
        roles.command(
            "py",
            [
                sys.executable,
                "-c",
                "import sys; print('a'); sys.stdout.flush(); print('b', end=''); print('c', file=sys.stderr)",
            ],
            on_output=lambda role, which, data: out.append((which, data)),
        )
        roles.supervise(START_S, need_result=False)
    assert roles[0].exitcode == 0
    assert b"".join(d for w, d in out if w == "stdout") == b"a\nb"
    assert [d for w, d in out if w == "stderr"] == [b"c\n"] and list(roles[0].tail) == ["c"]
