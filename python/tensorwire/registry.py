"""A registration cache for memory tensorwire does not own (the tensors of a
torch.distributed program), keyed by the allocation that holds the tensor.

Registering memory (``ucp_mem_map``) costs microseconds to milliseconds; a
program sends the same buffers again and again (DDP's buckets, FSDP's flat
parameters, a pipeline's activations of one shape). So one registration per
allocation (a torch storage, a numpy array's base), reused by every tensor
inside it. Each entry holds its allocation alive: the range cannot be freed
and handed to another allocation while a registration points at it (no stale
registration, no memory hooks needed). The cache is bounded (entries and
bytes, least recently used dropped first); a dropped entry's memory returns
to its allocator once the caller lets go of it, and its exports to peers end
with it (docs/contracts.md section 11).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional


DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_BYTES = 8 << 30


class RegistrationCache:
    """Registrations of allocations, least recently used dropped first.

    Args:
        device: the tensorwire Device that registers.
        max_entries, max_bytes: bounds on what the cache holds alive.
        register: makes the entry for (address, nbytes) (default: the device's registration;
            tensorwire.sharing.share_in_place keeps shares in a cache of their own).
        release: called with an entry when it leaves the cache (default: nothing, the entry
            ends when dropped).
    """

    def __init__(self, device: Any, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES, register: Optional[Callable[[int, int], Any]] = None,
                 release: Optional[Callable[[Any], None]] = None) -> None:
        self.device = device
        self.register = register
        self.release = release
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[tuple[int, int], tuple[Any, Any]] = OrderedDict()
        self.held = 0
        self.on_drops: dict[int, list[Callable[[], None]]] = {}
        self.hits = self.misses = 0

    def lookup(self, owner: Any) -> Any:
        """The registration of the allocation `owner`: (address, nbytes, keepalive), e.g. a torch
        storage's, or a function returning it (asked only when needed)."""
        if callable(owner):
            owner = owner()
        ptr, nbytes, keep = owner
        key = (int(ptr), int(nbytes))
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            return hit[0]
        self.misses += 1
        reg = (self.register or self.device.register_memory)(key[0], max(key[1], 1))
        self.entries[key] = (reg, keep)
        self.held += key[1]
        while len(self.entries) > 1 and (len(self.entries) > self.max_entries or self.held > self.max_bytes):
            self._drop(next(iter(self.entries)))
        return reg

    def cached(self, owner: Any) -> Any:
        """The registration of the allocation `owner` if the cache holds one, else None (never
        registers)."""
        if callable(owner):
            owner = owner()
        hit = self.entries.get((int(owner[0]), int(owner[1])))
        return None if hit is None else hit[0]

    def on_drop(self, reg: Any, callback: Callable[[], None]) -> None:
        """Calls `callback` when `reg` leaves the cache (its exports end with it)."""
        self.on_drops.setdefault(id(reg), []).append(callback)

    def _drop(self, key: tuple[int, int]) -> None:
        reg, _keep = self.entries.pop(key)
        self.held -= key[1]
        for cb in self.on_drops.pop(id(reg), []):
            cb()
        if self.release is not None:
            self.release(reg)

    def clear(self) -> None:
        """Drops every registration (process group destruction)."""
        while self.entries:
            self._drop(next(iter(self.entries)))

    def __len__(self) -> int:
        return len(self.entries)
