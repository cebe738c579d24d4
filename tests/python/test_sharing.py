"""Memory shared in place (tensorwire.sharing): the allocation keeps its address and contents, a
second process that is given the ticket maps exactly its whole pages and reads and writes them,
release puts private pages back, and what must not be shared is refused (docs/torch.md)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tensorwire import sharing
from tensorwire.registry import RegistrationCache

PAGE = sharing.PAGE


def _allocation(nbytes: int) -> np.ndarray:
    """A malloc'ed array (numpy's own buffer) with a pattern in it."""
    a = np.empty(nbytes, dtype=np.uint8)
    a[:] = np.arange(nbytes) % 251
    return a


def _maps_line(addr: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= addr < end:
                return line.strip()
    raise AssertionError(f"{addr:#x} is not mapped")


def test_a_share_keeps_address_and_contents_and_release_gives_private_pages_back() -> None:
    a = _allocation(3 * PAGE * 64 + 123)
    want = a.copy()
    ptr = a.ctypes.data
    share = sharing.share_in_place(ptr, a.nbytes)
    lo, hi = sharing.interior(ptr, a.nbytes)
    assert (share.lo, share.length) == (lo, hi - lo) and lo >= ptr and hi <= ptr + a.nbytes
    assert a.ctypes.data == ptr and np.array_equal(a, want)
    assert "memfd:tensorwire-share" in _maps_line(lo) and "rw-s" in _maps_line(lo)
    a[PAGE * 10] = 7  # still the tensor's memory, written through the same address
    share.release()
    share.release()  # idempotent
    assert a[PAGE * 10] == 7 and np.array_equal(np.delete(a, PAGE * 10), np.delete(want, PAGE * 10))
    assert sharing.private_anonymous(lo, hi)


def test_another_process_maps_the_share_through_its_ticket_and_writes_into_it() -> None:
    a = _allocation(PAGE * 256 + 40)
    share = sharing.share_in_place(a.ctypes.data, a.nbytes)
    pid, fd, ino, length, at = share.ticket(a.ctypes.data)  # element `at` of a is the share's first byte
    child = textwrap.dedent(f"""
        import ctypes
        from tensorwire import sharing
        peers = sharing.PeerShares()
        addr = peers.address({pid}, {fd}, {ino}, {length})
        view = (ctypes.c_uint8 * {length}).from_address(addr)
        print(view[0], view[{length} - 1])
        view[5] = 200
        try:
            peers.address({pid}, {fd}, {ino} + 1, {length})
        except sharing.SharingError as e:
            print("REFUSED", e)
        peers.close()
    """)
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    first, last = run.stdout.split("\n")[0].split()
    assert (int(first), int(last)) == (a[at], a[at + length - 1])
    assert "REFUSED" in run.stdout and "not the share it named" in run.stdout
    assert a[at + 5] == 200  # the child's store landed in our allocation
    share.release()
    assert a[at + 5] == 200


def test_memory_that_is_not_mallocs_private_memory_is_not_shared() -> None:
    shared = mmap.mmap(-1, PAGE * 4)  # anonymous but MAP_SHARED: shared with children already
    view = np.frombuffer(shared, dtype=np.uint8)
    with pytest.raises(sharing.SharingError, match="not private anonymous"):
        sharing.share_in_place(view.ctypes.data, view.nbytes)
    del view
    shared.close()
    small = _allocation(PAGE // 2)
    with pytest.raises(sharing.SharingError, match="no whole page"):
        sharing.share_in_place(small.ctypes.data, small.nbytes)


def test_private_anonymous_reads_the_whole_range() -> None:
    maps = ("1000-3000 rw-p 00000000 00:00 0 \n"
            "3000-4000 rw-p 00000000 00:00 0 [heap]\n"
            "4000-4800 rw-p 00000000 00:00 0 [anon: glibc: malloc arena]\n"
            "5000-6000 rw-p 00000000 00:00 0 \n"
            "6000-7000 rw-s 00000000 00:01 9 /memfd:x (deleted)\n"
            "7000-8000 rw-p 00000000 08:01 9 /lib/data\n")
    assert sharing.private_anonymous(0x1000, 0x4800, maps)
    assert not sharing.private_anonymous(0x1000, 0x5000, maps)   # a gap
    assert not sharing.private_anonymous(0x5000, 0x7000, maps)   # shared
    assert not sharing.private_anonymous(0x7000, 0x8000, maps)   # a file
    assert not sharing.private_anonymous(0x9000, 0xa000, maps)   # not mapped at all


def test_peer_shares_map_only_shares_of_processes_they_can_open(tmp_path) -> None:
    peers = sharing.PeerShares()
    with pytest.raises(sharing.SharingError, match="cannot open process"):
        peers.address(2 ** 22 + 12345, 3, 1, PAGE)
    f = tmp_path / "not-a-share"
    f.write_bytes(b"x" * PAGE)
    fd = os.open(f, os.O_RDWR)
    try:  # a ticket naming any other file of a process (here our own) is refused before mapping
        with pytest.raises(sharing.SharingError, match="not a tensorwire share"):
            peers.address(os.getpid(), fd, os.fstat(fd).st_ino, PAGE)
    finally:
        os.close(fd)
    assert not peers.maps


def test_the_cache_releases_shares_it_drops() -> None:
    released = []

    def release(share: sharing.Share) -> None:
        released.append(share.lo)
        share.release()
    cache = RegistrationCache(None, max_entries=1, register=sharing.share_in_place, release=release)
    a, b = _allocation(PAGE * 8), _allocation(PAGE * 8)
    first = cache.lookup((a.ctypes.data, a.nbytes, a))
    cache.lookup((b.ctypes.data, b.nbytes, b))  # over max_entries: a's share leaves
    assert released == [first.lo] and sharing.private_anonymous(first.lo, first.lo + first.length)
    cache.clear()
    assert len(released) == 2 and len(cache) == 0
