"""TeraSort's pieces that need no processes: sampling, the range partitioner,
the local sort and TeraValidate's checks (numpy only; unit-testable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .teragen import KEY, RECORD, checksum, gather, keys_of


def key_hex(records: np.ndarray, i: int) -> str:
    return records[i, :KEY].tobytes().hex()


def sample_keys(records: np.ndarray, count: int, splits: int = 10) -> np.ndarray:
    """Up to `count` keys (uint8[k, 10]) read from `splits` evenly spaced
    places of the input, like TeraInputFormat.writePartitionFile (which reads
    the first count/splits records of each of 10 splits)."""
    n = records.shape[0]
    if n == 0 or count <= 0:
        return np.zeros((0, KEY), dtype=np.uint8)
    if count >= n:
        return np.array(records[:, :KEY])
    splits = max(1, min(splits, count))
    per = -(-count // splits)
    starts = (np.arange(splits, dtype=np.int64) * n) // splits
    idx = (starts[:, None] + np.arange(per, dtype=np.int64)[None, :]).reshape(-1)
    idx = np.unique(np.minimum(idx, n - 1))[:count]
    return np.array(records[idx, :KEY])


def _sort_order(keys: np.ndarray) -> np.ndarray:
    """Stable order of uint8[n, >=10] keys (unsigned lexicographic)."""
    hi, lo = keys_of(keys if keys.shape[1] == RECORD else _pad(keys))
    return np.lexsort((lo, hi))


def _pad(keys: np.ndarray) -> np.ndarray:
    out = np.zeros((keys.shape[0], RECORD), dtype=np.uint8)
    out[:, :KEY] = keys[:, :KEY]
    return out


def pick_splitters(samples: np.ndarray, parts: int) -> np.ndarray:
    """TeraSort's split points: sort the sampled keys, take the one at
    round(i * n / parts) for i = 1..parts-1 (uint8[parts-1, 10])."""
    if parts <= 1 or samples.shape[0] == 0:
        return np.zeros((0, KEY), dtype=np.uint8)
    s = samples[_sort_order(samples)]
    n = s.shape[0]
    step = n / parts
    idx = [min(n - 1, int(round(step * i))) for i in range(1, parts)]
    return np.array(s[idx, :KEY])


def partition_of(records: np.ndarray, splitters: np.ndarray) -> np.ndarray:
    """Destination of each record: the first i with splitters[i] > key
    (TotalOrderPartitioner), i.e. the number of splitters <= key (int64[n])."""
    n = records.shape[0]
    if splitters.shape[0] == 0:
        return np.zeros(n, dtype=np.int64)
    hi, lo = keys_of(records)
    shi, slo = keys_of(_pad(splitters))
    left = np.searchsorted(shi, hi, side="left")
    right = np.searchsorted(shi, hi, side="right")
    dest = left.astype(np.int64)
    tie = np.nonzero(right > left)[0]  # the 64-bit prefix equals a splitter's: compare the last 2 bytes too
    for i in tie:
        dest[i] = left[i] + int(np.count_nonzero(slo[left[i] : right[i]] <= lo[i]))
    return dest


def sort_order(records: np.ndarray) -> np.ndarray:
    """The permutation that orders records by key, equal to a stable sort's: one
    argsort of the first 8 key bytes, or, when some of those are equal (rare for
    TeraGen keys), a stable sort on all 10."""
    hi, lo = keys_of(records)
    order = np.argsort(hi)
    ordered = hi[order]
    if np.any(ordered[1:] == ordered[:-1]):
        order = np.lexsort((lo, hi))
    return order


def sort_records(records: np.ndarray) -> np.ndarray:
    """The records ordered by key (as a stable sort would), as a new array."""
    if records.shape[0] == 0:
        return records.copy()
    return gather(records, sort_order(records))


def misorders(records: np.ndarray) -> tuple[int, int]:
    """(number of rows whose key is below the previous row's, index of the first such row or -1)."""
    if records.shape[0] < 2:
        return 0, -1
    hi, lo = keys_of(records)
    bad = (hi[1:] < hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] < lo[:-1]))
    where = np.flatnonzero(bad)
    return int(where.size), int(where[0]) + 1 if where.size else -1


def summarize(records: np.ndarray, part: int) -> dict[str, Any]:
    """One output partition as TeraValidate's mapper sees it: row count, first
    and last key, misorders and the CRC-32 sum."""
    n = int(records.shape[0])
    bad, first_bad = misorders(records)
    return {
        "part": part,
        "rows": n,
        "first": key_hex(records, 0) if n else None,
        "last": key_hex(records, n - 1) if n else None,
        "misorders": bad,
        "first_misorder": first_bad,
        "checksum": hex(checksum(records)),
    }


@dataclass
class Validation:
    errors: list[str] = field(default_factory=list)
    rows: int = 0
    checksum: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def validate(summaries: Sequence[dict[str, Any]], expected_rows: int, expected_checksum: int) -> Validation:
    """TeraValidate's reduce: order within each partition, boundaries increasing
    across partitions, total rows and the checksum equal to the generator's."""
    v = Validation()
    last: tuple[int, str] | None = None
    for s in sorted(summaries, key=lambda s: s["part"]):
        v.rows += s["rows"]
        v.checksum += int(s["checksum"], 16)
        if s["misorders"]:
            v.errors.append(
                f"misorder in partition {s['part']}: {s['misorders']} row(s) below their predecessor, "
                f"first: row {s['first_misorder']}"
            )
        if s["rows"]:
            if last is not None and last[1] > s["first"]:
                v.errors.append(
                    f"bad key partitioning: partition {last[0]} ends at {last[1]}, "
                    f"partition {s['part']} begins at {s['first']}"
                )
            last = (s["part"], s["last"])
    if v.rows != expected_rows:
        v.errors.append(f"row count {v.rows} != {expected_rows} generated")
    if v.checksum != expected_checksum:
        v.errors.append(f"checksum {v.checksum:x} != generator's {expected_checksum:x}")
    return v
