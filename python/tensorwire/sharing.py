"""Memory shared in place with same-host peers: the host-memory form of the paper's to-be-sent
tensors in registered memory, for tensors tensorwire did not allocate (a torch program's).

A tensor torch allocated is private to its process: a peer on the same host reaches it only
through the kernel's cross-memory copy (cma), or through a copy into memory both map (the torch
backend's landing areas), so every byte an all_reduce moves is copied two or three times.
Sharing in place swaps the private pages under an allocation for the pages of a memfd with the
same contents, at the same addresses (copy into the memfd, then ``mremap`` it over them: the
tensor does not move and no pointer changes). A peer given the share's ticket opens
``/proc/<pid>/fd/<fd>`` and maps exactly those pages; from then on it reads and writes the tensor
with plain loads and stores. The kernel lets a process open another's fd only with ptrace read
access to it, the access cma already needs: sharing opens nothing to a process that could not
already read and write this memory.

Rules (each one checked here, by the owner):

* Only whole pages inside the allocation are shared: its first and last partial pages may hold
  other allocations' bytes, which a peer must not reach. The caller moves those few bytes another way.
* Only private anonymous memory (what malloc hands out): a file mapping or memory that is already
  shared (``Tensor.share_memory_()``) keeps its own backing.
* The owner keeps the allocation alive while it is shared (tensorwire.registry.RegistrationCache
  holds it); when it leaves the cache, ``Share.release`` puts private pages with the same contents
  back (copy, ``mremap``), so the allocator gets back what it handed out.
* A ``fork()`` while a share is live gives the child the same pages, not a copy (MAP_SHARED).

The pages are a memfd's, not ``/dev/shm``'s: a container's small ``/dev/shm`` does not limit them.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict

from .errors import Error

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PROT_RW = 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_ANONYMOUS = 0x01, 0x02, 0x20
_MAP_POPULATE = 0x8000  # fault every page in at once: one call instead of a fault per page
_MREMAP_MAYMOVE, _MREMAP_FIXED = 0x1, 0x2
_FAILED = ctypes.c_void_p(-1).value
MEMFD_NAME = "tensorwire-share"  # a peer maps only files of this name: a ticket cannot point it at another file

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mremap = _libc.mremap
_mremap.restype = ctypes.c_void_p
_mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_memmove = _libc.memmove  # through the CDLL: the GIL is released while it copies
_memmove.restype = ctypes.c_void_p
_memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class SharingError(Error, OSError):
    """Memory could not be shared in place, or a peer's share could not be mapped."""


def _os_error(what: str) -> SharingError:
    e = ctypes.get_errno()
    return SharingError(f"{what}: {os.strerror(e)} (errno {e})")


def interior(ptr: int, nbytes: int) -> tuple[int, int]:
    """[lo, hi): the whole pages inside [ptr, ptr + nbytes) (empty when there are none)."""
    lo = (ptr + PAGE - 1) // PAGE * PAGE
    hi = (ptr + nbytes) // PAGE * PAGE
    return lo, max(lo, hi)


def private_anonymous(lo: int, hi: int, maps: str | None = None) -> bool:
    """Whether every page of [lo, hi) is mapped private, anonymous and read-write (malloc's
    memory, which a newer glibc may name "[anon: glibc: malloc]"), per /proc/self/maps (or the
    text `maps`)."""
    if maps is None:
        with open("/proc/self/maps") as f:
            maps = f.read()
    at = lo
    for line in maps.splitlines():
        fields = line.split(None, 5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if end <= at or start >= hi:
            continue
        path = fields[5].strip() if len(fields) > 5 else ""
        if start > at or fields[1] != "rw-p" or not (path in ("", "[heap]") or path.startswith("[anon:")):
            return False
        at = end
        if at >= hi:
            return True
    return at >= hi


def _move_over(src: int, dst: int, length: int) -> None:
    """Moves the mapping at src onto dst (replacing what was there in one step)."""
    got = _mremap(src, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, dst)
    if got == _FAILED or got != dst:
        err = _os_error("mremap")
        _munmap(src, length)
        raise err


class Share:
    """The whole pages of one allocation, shared in place (see the module docs)."""

    __slots__ = ("ptr", "nbytes", "lo", "length", "fd", "ino")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self.lo, hi = interior(ptr, nbytes)
        self.length = hi - self.lo
        self.fd = -1
        self.ino = 0
        if self.length == 0:
            raise SharingError(f"[{ptr:#x}, +{nbytes}) holds no whole page to share")
        if not private_anonymous(self.lo, hi):
            raise SharingError(f"[{self.lo:#x}, {hi:#x}) is not private anonymous memory: not shared in place")
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.length)
            tmp = _mmap(None, self.length, _PROT_RW, _MAP_SHARED | _MAP_POPULATE, fd, 0)
            if tmp == _FAILED:
                raise _os_error("mmap of the share")
            _memmove(tmp, self.lo, self.length)
            _move_over(tmp, self.lo, self.length)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.ino = fd, os.fstat(fd).st_ino

    def ticket(self, base: int) -> tuple[int, int, int, int, int]:
        """What a peer needs to map it and find its tensor in it: (pid, fd, inode, length, where the
        share starts relative to `base`, e.g. the tensor's or its registration's address).
        PeerShares.address takes the first four."""
        return os.getpid(), self.fd, self.ino, self.length, self.lo - base

    def release(self) -> None:
        """Puts private pages with the same contents back under the allocation (idempotent)."""
        if self.fd < 0:
            return
        tmp = _mmap(None, self.length, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_POPULATE, -1, 0)
        if tmp == _FAILED:
            raise _os_error("mmap while releasing a share")
        _memmove(tmp, self.lo, self.length)
        _move_over(tmp, self.lo, self.length)
        os.close(self.fd)
        self.fd = -1


def share_in_place(ptr: int, nbytes: int) -> Share:
    """Shares the whole pages of the allocation [ptr, ptr + nbytes) in place (a RegistrationCache's
    `register`); SharingError when they are not private anonymous memory or there are none."""
    return Share(int(ptr), int(nbytes))


class PeerShares:
    """The peers' shares this process mapped, by (pid, fd, inode): the least recently used
    unmapped beyond `max_entries` (a mapping keeps the owner's pages allocated)."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self.maps: OrderedDict[tuple[int, int, int], tuple[int, int]] = OrderedDict()

    def address(self, pid: int, fd: int, ino: int, length: int) -> int:
        """Where the share (pid, fd, ino) of `length` bytes is mapped here (mapped on first use)."""
        key = (int(pid), int(fd), int(ino))
        hit = self.maps.get(key)
        if hit is not None and hit[1] >= length:
            self.maps.move_to_end(key)
            return hit[0]
        for old in [k for k in self.maps if k[:2] == key[:2]]:  # that fd holds another file now
            self._unmap(old)
        try:
            f = os.open(f"/proc/{key[0]}/fd/{key[1]}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise SharingError(f"cannot open process {pid}'s share (fd {fd}): {e.strerror}") from None
        try:
            st = os.fstat(f)
            if not os.readlink(f"/proc/self/fd/{f}").startswith(f"/memfd:{MEMFD_NAME}"):
                raise SharingError(f"process {pid}'s fd {fd} is not a tensorwire share: not mapped")
            if st.st_ino != key[2] or st.st_size < length:
                raise SharingError(f"process {pid}'s fd {fd} is not the share it named (inode {st.st_ino}, "
                                   f"{st.st_size} B; expected inode {ino}, {length} B)")
            addr = _mmap(None, length, _PROT_RW, _MAP_SHARED | _MAP_POPULATE, f, 0)
            if addr == _FAILED:
                raise _os_error(f"mmap of process {pid}'s share")
        finally:
            os.close(f)
        self.maps[key] = (addr, length)
        while len(self.maps) > self.max_entries:
            self._unmap(next(iter(self.maps)))
        return addr

    def _unmap(self, key: tuple[int, int, int]) -> None:
        addr, length = self.maps.pop(key)
        _munmap(addr, length)

    def close(self) -> None:
        while self.maps:
            self._unmap(next(iter(self.maps)))
