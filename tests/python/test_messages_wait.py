"""What a wait of the messages engine (tensorwire.ranks.messages) watches: a request that
completed between progress() and the wait must end the wait at once (progress has work for
it), except a write whose last record waits for credit (the credit word wakes that one)."""

from __future__ import annotations

from typing import Any

from tensorwire.ranks import messages


class Done:
    def done(self) -> bool:
        return True


class Running:
    def done(self) -> bool:
        return False


def op(kind: str, req: Any, queued: bool = False) -> messages.Op:
    o = messages.Op(kind, 1, 0, 0, 0, 8, None)
    o.req, o.queued = req, queued
    return o


def test_a_wait_watches_reads_and_writes_progress_has_work_for(monkeypatch) -> None:
    seen: list[list[Any]] = []
    monkeypatch.setattr(messages._core, "wait_any", lambda items, timeout=None: seen.append(list(items)) or 0)
    m = object.__new__(messages.Messenger)
    m.n, m.rank, m.failed, m.lay = 1, 0, {}, None  # no peer ring to watch: only the requests
    read_done, read_running, write_done, write_running, write_queued = Done(), Running(), Done(), Running(), Done()
    m.reading = [op("recv", read_done), op("recv", read_running)]
    m.writing = [op("send", write_done), op("send", write_running), op("send", write_queued, queued=True)]
    m._block(1.0, {1})
    assert len(seen) == 1
    watched = seen[0]
    assert read_done in watched and write_done in watched, "a completed read or write must end the wait"
    assert read_running in watched and write_running in watched
    assert write_queued not in watched, "a done write waiting for credit would end every wait at once"


def test_compare_swap_stays_inside_its_region() -> None:
    """The claim words' compare-and-swap refuses an offset outside the region, including one
    whose end wraps around (offset + 8 overflowing 64 bits), before touching memory."""
    import numpy as np
    import pytest

    import tensorwire as tw
    from tensorwire import _core
    with tw.Device(host="127.0.0.1", transport="shm") as dev:
        block = dev.empty((4,), "uint64")
        words = np.asarray(block)
        assert _core._compare_swap(block, 8, 0, 5) == 0 and int(words[1]) == 5
        assert _core._compare_swap(block, 8, 0, 7) == 5 and int(words[1]) == 5  # expected 0: no swap
        for offset in (2**64 - 8, 32, 3):
            with pytest.raises(tw.InvalidArgument, match="outside the region"):
                _core._compare_swap(block, offset, 0, 1)
