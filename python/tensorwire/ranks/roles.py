"""Local roles: start them, supervise them, name the first that failed, stop the rest.

Every local launcher of tensorwire runs on this module: `tensorwire run`
(its ranks are commands), the parameter server's train() (processes, or
threads of this process), partition's stage processes and the receiver
processes of the benchmarks.

A :class:`Roles` group starts each role as

* ``spawn(name, target, *args)``: ``target(conn, *args)`` in a process of the
  multiprocessing "spawn" context (never fork: UCX runs threads), ``conn``
  being its end of a pipe to the parent;
* ``thread(name, target, *args)``: the same call in a thread of this process
  (a real pipe between the two ends, so both look alike to the parent);
* ``command(name, argv)``: a program in a session of its own (stopping it
  signals its whole process group), its output handed to a callback line by
  line and the last lines of its stderr kept.

What a role sends is a tuple led by a tag. Two tags mean something to the
supervisor: ``("result", value)`` (the role did its part) and ``("error",
text[, when])`` (it failed, in its own words; ``when``: its
``time.monotonic()``). Any other message waits in the role's inbox for
:meth:`Role.recv` or :meth:`Roles.gather`.

:meth:`Roles.supervise` waits in one ``multiprocessing.connection.wait`` on
every role's sentinel, pipe and output, bounded by the time left (no sleep
and poll). A role fails when it reports an error, exits non-zero, or exits
before its result when results are expected. Once one failed the others get
``linger`` seconds to finish or fail on their own (they notice a dead peer
and say so), then the rest are stopped (SIGTERM, then SIGKILL after
``grace`` seconds) and :class:`RoleError` names the first failure: a role
that died without a word before those that reported errors (they usually
failed because it died), one killed by a signal before one that exited,
then the earliest.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import subprocess
import threading
import time
import traceback
from typing import Any, Callable, Iterator

from ..errors import Error

GRACE_S = 3.0  # between SIGTERM and SIGKILL
TAIL_LINES = 10  # of a command's stderr, kept for the failure's message
_NO_PIDFD_TICK_S = 0.05  # where os.pidfd_open is missing, how often a command's exit is polled


def describe_exit(code: int | None) -> str:
    """'exited with code 3', 'was killed by SIGKILL' (a negative code), 'is still running' (None)."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _named(name: str, text: str) -> str:
    text = text.strip()
    return text if text.startswith(name) else f"{name}: {text}"


class RoleError(Error):
    """Roles failed. ``first`` is the role that failed first (None for a timeout
    or an interrupt), ``failed`` every role that failed on its own (the first
    first), ``timed_out`` and ``interrupted`` (the signal) say why else the
    roles were stopped."""

    def __init__(
        self,
        message: str,
        first: "Role | None" = None,
        failed: list["Role"] | None = None,
        timed_out: bool = False,
        interrupted: int | None = None,
    ) -> None:
        super().__init__(message)
        self.first, self.failed = first, list(failed or ([first] if first else []))
        self.timed_out, self.interrupted = timed_out, interrupted


class _ThreadRun:
    """A thread that ends like a process: an exit code, and a sentinel that turns readable."""

    def __init__(self, name: str, target: Callable, args: tuple, conn: Any) -> None:
        self.exitcode: int | None = None
        self.trace = ""
        self.sentinel, done = mp.Pipe(duplex=False)

        def body() -> None:
            try:
                target(conn, *args)
                self.exitcode = 0
            except SystemExit as e:
                self.exitcode = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - the role's failure, reported by the supervisor
                self.trace = traceback.format_exc()
                self.exitcode = 1
            finally:
                conn.close()
                done.close()  # the sentinel reads EOF: the thread is done

        self.thread = threading.Thread(target=body, daemon=True, name=f"tensorwire-{name}")
        self.thread.start()


class Role:
    """One started role: its pipe (``conn``, None for a command), what it
    reported (``result``, ``error``, ``inbox``) and how it ended."""

    def __init__(
        self,
        name: str,
        kind: str,
        handle: Any,
        conn: Any,
        sentinel: Any,
        streams: dict | None = None,
        on_output: Callable | None = None,
    ) -> None:
        self.name, self.kind, self.handle, self.conn = name, kind, handle, conn
        self.result: Any = None
        self.has_result = False
        self.error: str | None = None
        self.failed_at: float | None = None  # when it failed (its own clock for a reported error)
        self.stopped: str | None = None  # why the launcher stopped it
        self.inbox: collections.deque = collections.deque()
        self.tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        self._sentinel = sentinel
        self._streams = streams or {}  # file -> [stream name, partial line]
        self._on_output = on_output
        self._exited = False  # its exit seen and its pipe drained
        self._eof = conn is None

    def __repr__(self) -> str:
        return f"<Role {self.name!r} {self.kind} {describe_exit(self.exitcode)}>"

    @property
    def pid(self) -> int | None:
        return getattr(self.handle, "pid", None)

    @property
    def exitcode(self) -> int | None:
        if self.kind == "command":
            return self.handle.poll()
        return self.handle.exitcode

    @property
    def alive(self) -> bool:
        return not self._exited and self.exitcode is None

    # --- talking to it -----------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float, what: str = "answer") -> Any:
        """Its next message; RoleError when it reported an error or exited
        instead (what came before is returned first), TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not self.inbox:
            if self.error is not None:
                raise RoleError(_named(self.name, self.error), self)
            if self._exited:
                raise RoleError(f"{self.name} {describe_exit(self.exitcode)}{self._tail_text()}", self)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name} did not {what} within {timeout:g} s")
            mine = [w for w in self._waitables() if w is self.conn or w is self._sentinel]
            for w in mpc.wait(mine, left):
                if w is self.conn:
                    self._drain()
                else:
                    self._note_exit(time.monotonic())
        return self.inbox.popleft()

    def take(self, tag: str) -> tuple | None:
        """The first message in the inbox tagged `tag` (removed), or None."""
        for m in self.inbox:
            if isinstance(m, tuple) and m and m[0] == tag:
                self.inbox.remove(m)
                return m
        return None

    # --- how it went -------------------------------------------------------------------------

    def failure(self, need_result: bool = True) -> str | None:
        """Why it failed (its own words where it reported them), or None while it has not."""
        if self.error is not None:
            return self.error
        if need_result and self.has_result:
            return None
        if self.stopped is not None:
            return self.stopped
        if not self._exited:
            return None
        code = self.exitcode
        if code != 0:
            return describe_exit(code) + (" before its result" if need_result and not self.has_result else "")
        if need_result and not self.has_result:
            return "exited with code 0 before its result"
        return None

    def done(self, need_result: bool = True) -> bool:
        if self.failure(need_result) is not None:
            return True
        return self.has_result if need_result else self._exited and not self._streams

    def describe(self, need_result: bool = True) -> str:
        """'<name>: <its error>' or '<name> exited with code 3' and the last lines of its stderr."""
        why = self.failure(need_result) or describe_exit(self.exitcode)
        if self.error is not None:
            return _named(self.name, why)
        return f"{self.name} {why}{self._tail_text()}"

    def _tail_text(self) -> str:
        return "".join(f"\n    {line}" for line in self.tail)

    # --- what the supervisor's wait found ------------------------------------------------------

    def _waitables(self) -> list:
        out = [] if self._eof else [self.conn]
        if not self._exited and self._sentinel is not None:
            out.append(self._sentinel)
        return out + list(self._streams)

    def _drain(self) -> None:
        """Every message its pipe holds now, into the inbox ("result" and "error" into their fields)."""
        try:
            while not self._eof and self.conn.poll(0):
                self._take_message(self.conn.recv())
        except (EOFError, OSError):
            self._eof = True
        except Exception as e:  # noqa: BLE001 - an unreadable report is a failure of that role
            self._fail(f"unreadable report: {type(e).__name__}: {e}", time.monotonic())

    def _take_message(self, msg: Any) -> None:
        tag = msg[0] if isinstance(msg, tuple) and msg else None
        if tag == "result":
            self.result, self.has_result = msg[1], True
        elif tag == "error":
            when = msg[2] if len(msg) > 2 and isinstance(msg[2], float) else time.monotonic()
            self._fail(str(msg[1]), when)
        else:
            self.inbox.append(msg)

    def _fail(self, text: str, when: float) -> None:
        if self.error is None:
            self.error, self.failed_at = text, when

    def _note_exit(self, now: float, wait: float = 5.0) -> None:
        """It ended: reap it, read what its pipe still holds."""
        if self._exited:
            return
        if self.kind == "process":
            self.handle.join(wait)
        elif self.kind == "command":
            try:
                self.handle.wait(wait)
            except subprocess.TimeoutExpired:
                return
            if isinstance(self._sentinel, int):
                os.close(self._sentinel)
        else:
            self.handle.thread.join(wait)
            self._sentinel.close()
            if self.handle.trace:
                self.tail.extend(self.handle.trace.strip().splitlines()[-TAIL_LINES:])
        if self.exitcode is None:
            return
        self._drain()
        self._exited = True
        if self.failed_at is None:
            self.failed_at = now

    def _read_stream(self, f: Any) -> None:
        which, partial = self._streams[f]
        chunk = os.read(f.fileno(), 65536)
        if not chunk:
            del self._streams[f]
            f.close()
            if partial:
                self._output(which, partial)
            return
        *lines, rest = (partial + chunk).split(b"\n")
        self._streams[f][1] = rest
        if lines:
            self._output(which, b"\n".join(lines) + b"\n")

    def _output(self, which: str, data: bytes) -> None:
        if which == "stderr":
            self.tail.extend(data.decode(errors="replace").splitlines())
        if self._on_output is not None:
            self._on_output(self, which, data)

    def _signal(self, sig: int) -> None:
        if not self.alive or self.kind == "thread":  # a thread cannot be stopped; its waits are bounded
            return
        try:
            if self.kind == "command":
                os.killpg(self.handle.pid, sig)
            else:
                os.kill(self.handle.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@contextlib.contextmanager
def _env_defaults(env: dict[str, str] | None) -> Iterator[None]:
    """`env` in os.environ while a process starts (a variable already set keeps its value)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    for k, v in (env or {}).items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


class _Interrupts:
    """SIGINT and SIGTERM recorded, and a socket the wait wakes up on (main thread only)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.sock: socket.socket | None = None

    def __enter__(self) -> "_Interrupts":
        if threading.current_thread() is not threading.main_thread():
            return self
        self.sock, self._w = socket.socketpair()
        for s in (self.sock, self._w):
            s.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._on) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        if self.sock is None:
            return
        for s, h in self._old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._old_fd)
        self.sock.close()
        self._w.close()


class Roles:
    """A group of local roles (see the module's doc). A context manager: on
    leaving it every role still running is stopped (on a normal exit, after
    the grace to end on its own)."""

    def __init__(self, grace: float = GRACE_S) -> None:
        self.roles: list[Role] = []
        self.grace = grace

    def __enter__(self) -> "Roles":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop("killed by the launcher on its way out", wait=0.0 if exc_type else self.grace)

    def __iter__(self) -> Iterator[Role]:
        return iter(self.roles)

    def __len__(self) -> int:
        return len(self.roles)

    def __getitem__(self, i: int) -> Role:
        return self.roles[i]

    # --- starting ----------------------------------------------------------------------------

    def spawn(self, name: str, target: Callable, *args: Any, env_defaults: dict[str, str] | None = None) -> Role:
        """``target(conn, *args)`` in a spawned process; `env_defaults`: variables
        it starts with, unless this process sets them already."""
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=f"tensorwire-{name.replace(' ', '-')}")
        with _env_defaults(env_defaults):
            proc.start()
        child.close()  # the child's end: its exit then reads as EOF here
        return self._add(Role(name, "process", proc, conn, proc.sentinel))

    def thread(self, name: str, target: Callable, *args: Any) -> Role:
        """``target(conn, *args)`` in a thread of this process (SystemExit ends it
        with that code; an exception with code 1 and its traceback)."""
        conn, child = mp.Pipe()
        run = _ThreadRun(name, target, args, child)
        return self._add(Role(name, "thread", run, conn, run.sentinel))

    def command(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        on_output: Callable[[Role, str, bytes], None] | None = None,
    ) -> Role:
        """`argv` in a session of its own. ``on_output(role, "stdout" | "stderr",
        data)`` gets its output in whole lines (the last one maybe without its
        newline); without it stdout is inherited. stderr's last lines are kept."""
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE if on_output else None, stderr=subprocess.PIPE, start_new_session=True
        )
        streams = {f: [which, b""] for f, which in ((proc.stdout, "stdout"), (proc.stderr, "stderr")) if f is not None}
        try:
            sentinel: Any = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            sentinel = None
        return self._add(Role(name, "command", proc, None, sentinel, streams, on_output))

    def _add(self, role: Role) -> Role:
        self.roles.append(role)
        return role

    # --- talking to them ---------------------------------------------------------------------

    def broadcast(self, msg: Any, roles: list[Role] | None = None) -> None:
        """`msg` to each role with a pipe (one that died meanwhile is the supervisor's to notice)."""
        for r in roles or self.roles:
            if r.conn is not None and not r._eof:
                try:
                    r.conn.send(msg)
                except OSError:
                    pass

    def gather(self, tag: str, timeout: float, roles: list[Role] | None = None, during: str = "setup") -> list[tuple]:
        """The first message tagged `tag` from each of `roles` (default: all), in
        their order. RoleError as soon as a role of the group fails (exits, or
        reports an error) or, with timed_out, when `timeout` s pass first."""
        roles = list(roles or self.roles)
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while True:
            for i, r in enumerate(roles):
                if i not in got and (m := r.take(tag)) is not None:
                    got[i] = m
            if len(got) == len(roles):
                return [got[i] for i in range(len(roles))]
            failed = [r for r in self.roles if r.error is not None or r._exited]
            if failed:
                first = _ordered(failed, self.roles)[0]
                text = (
                    _named(first.name, first.error)
                    if first.error is not None
                    else f"{first.name} {describe_exit(first.exitcode)} during {during}{first._tail_text()}"
                )
                raise RoleError(text, first, _ordered(failed, self.roles))
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(r.name for i, r in enumerate(roles) if i not in got)
                raise RoleError(f"{missing} did not finish {during} within {timeout:g} s", timed_out=True)
            self._pump(left)

    # --- supervising -------------------------------------------------------------------------

    def supervise(
        self,
        timeout: float | None = None,
        *,
        linger: float = 0.0,
        need_result: bool = True,
        interruptible: bool = False,
        before_stop: Callable[[RoleError], None] | None = None,
    ) -> None:
        """Waits until every role is done: has reported its result (need_result)
        or exited with code 0 and closed its output. Raises RoleError, with
        every role stopped, when one failed (after `linger` s for the others to
        finish or fail on their own), after `timeout` s (timed_out), or on
        SIGINT/SIGTERM (interruptible: the main thread only). `before_stop`
        gets the error before the others are stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        linger_end: float | None = None
        with _Interrupts() if interruptible else contextlib.nullcontext() as intr:
            while True:
                failed = [r for r in self.roles if r.failure(need_result) is not None]
                pending = [r for r in self.roles if not r.done(need_result)]
                now = time.monotonic()
                if failed and linger_end is None:
                    linger_end = now + linger
                err = None
                if intr is not None and intr.signum is not None:
                    err = RoleError(f"interrupted by {signal.Signals(intr.signum).name}", interrupted=intr.signum)
                elif failed and (not pending or (linger_end is not None and now >= linger_end)):
                    err = self._failure(failed, need_result)
                elif not pending:
                    return
                elif deadline is not None and now >= deadline:
                    err = RoleError(
                        f"timed out after {timeout:g} s; still running: {', '.join(r.name for r in pending)}",
                        timed_out=True,
                    )
                if err is not None:
                    if before_stop is not None:
                        before_stop(err)
                    self.stop(
                        "killed by the launcher "
                        + (
                            "after another role failed"
                            if err.first
                            else "at the timeout"
                            if err.timed_out
                            else "on a signal"
                        )
                    )
                    raise err
                ends = [t for t in (deadline, linger_end) if t is not None]
                self._pump(max(0.0, min(ends) - now) if ends else None, intr.sock if intr is not None else None)

    def _failure(self, failed: list[Role], need_result: bool) -> RoleError:
        ordered = _ordered(failed, self.roles)
        first = ordered[0]
        text = first.describe(need_result)
        said = [(r.name, r.error) for r in ordered if r.error is not None]
        if first.error is None and said:
            text += f"; then {_named(*said[0])}"
        return RoleError(text, first, ordered)

    def stop(self, why: str = "killed by the launcher", wait: float = 0.0) -> None:
        """Stops every role still running: gives them `wait` s to end on their
        own, then SIGTERM, then SIGKILL after the group's grace; reads their
        pipes and output meanwhile."""
        if wait > 0:
            self._pump_until(time.monotonic() + wait, lambda: not self._live())
        live = self._live()
        for r in live:
            if r.error is None and not r.has_result and r.stopped is None:
                r.stopped = why
            r._signal(signal.SIGTERM)
        self._pump_until(time.monotonic() + self.grace, lambda: not self._live())
        for r in self._live():
            r._signal(signal.SIGKILL)
        self._pump_until(time.monotonic() + 5.0, lambda: not self._live(processes_only=True))
        # what is left in the output pipes (a command's group is gone: they end)
        self._pump_until(time.monotonic() + self.grace, lambda: not any(r._streams for r in self.roles))
        for r in self.roles:
            if r.kind == "process" and r.conn is not None:
                r.conn.close()
                r._eof = True

    def _live(self, processes_only: bool = False) -> list[Role]:
        return [r for r in self.roles if r.alive and not (processes_only and r.kind == "thread")]

    def _pump_until(self, deadline: float, enough: Callable[[], bool]) -> None:
        while not enough():
            left = deadline - time.monotonic()
            if left <= 0 or not self._pump(left):
                return

    def _pump(self, timeout: float | None, extra: socket.socket | None = None) -> bool:
        """One wait on every pipe, sentinel and output still open, and what it
        found taken in; False when nothing is left to wait on."""
        owner: dict[Any, Role] = {}
        for r in self.roles:
            for w in r._waitables():
                owner[w] = r
        blind = [r for r in self.roles if r.alive and r._sentinel is None]
        if blind:  # no pidfd: a command's exit is polled
            timeout = _NO_PIDFD_TICK_S if timeout is None else min(timeout, _NO_PIDFD_TICK_S)
        if not owner and not blind:
            return False
        ready = mpc.wait(list(owner) + ([extra] if extra is not None else []), timeout)
        now = time.monotonic()
        for w in ready:
            if w is extra:
                with contextlib.suppress(OSError):
                    while extra.recv(4096):
                        pass
                continue
            r = owner[w]
            if w is r.conn:
                r._drain()
            elif w is r._sentinel:
                r._note_exit(now)
            elif w in r._streams:
                r._read_stream(w)
        for r in blind:
            if r.exitcode is not None:
                r._note_exit(now)
        return True


def _ordered(failed: list[Role], group: list[Role]) -> list[Role]:
    """Failed roles, the first failure first: one that died without a word
    (its peers usually failed because of it), killed by a signal before one
    that exited, then the earliest, then the group's order."""

    def key(r: Role) -> tuple:
        code = r.exitcode
        return (r.error is not None, not (code is not None and code < 0), r.failed_at or 0.0, group.index(r))

    return sorted(failed, key=key)
