"""TeraGen / gensort records, vectorised with numpy.

Record layout (gensort 1.1/1.2 "binary" records, what Hadoop's TeraGen writes;
docs/terasort.md), 100 bytes per row:

=======  =====  ==========================================================
offset   bytes  content
=======  =====  ==========================================================
0        10     key: the high 10 bytes of the row's 128-bit random value
10       2      ``00 11``
12       32     the row id as 32 upper-case ASCII hex digits
44       4      ``88 99 AA BB``
48       48     the low 48 bits of the random value as 12 hex digits,
                each written 4 times
96       4      ``CC DD EE FF``
=======  =====  ==========================================================

The random value of row ``r`` is ``f^(r+1)(0)`` for the 128-bit LCG
``f(x) = (A*x + C) mod 2**128`` (gensort's rand16): any row can be generated
on its own by skipping ahead, so ranks generate disjoint row ranges in
parallel and the result is identical to one ``gensort`` run.

The checksum is gensort's ``-c`` / TeraGen's CHECKSUM counter: the sum of the
CRC-32 (zlib's) of every 100-byte record, as a 128-bit number.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np

RECORD = 100
KEY = 10
MASK128 = (1 << 128) - 1
LCG_A = 0x2360ED051FC65DA44385DF649FCCF645
LCG_C = 0x4A696D47726179524950202020202001
_HEX = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


# -- the LCG on Python ints (skip-ahead by composing affine maps) --


def _compose(outer: tuple[int, int], inner: tuple[int, int]) -> tuple[int, int]:
    """outer(inner(x)) for affine maps (a, c): x -> a*x + c (mod 2**128)."""
    a1, c1 = outer
    a2, c2 = inner
    return (a1 * a2) & MASK128, (a1 * c2 + c1) & MASK128


def lcg_power(n: int) -> tuple[int, int]:
    """(a, c) with f^n(x) = a*x + c (mod 2**128), by repeated squaring."""
    if n < 0:
        raise ValueError("n must be >= 0")
    result, square = (1, 0), (LCG_A, LCG_C)
    while n:
        if n & 1:
            result = _compose(square, result)
        square = _compose(square, square)
        n >>= 1
    return result


def rand_of_row(row: int) -> int:
    """The 128-bit random value behind row `row`: f^(row+1)(0)."""
    return lcg_power(row + 1)[1]


# -- 128-bit arithmetic on numpy uint64 pairs (hi, lo) --


def _mul128(ahi, alo, bhi, blo):
    """(a * b) mod 2**128 for uint64 (hi, lo) arrays (broadcasting), via 32-bit limbs."""
    a = (alo & _M32, alo >> _S32, ahi & _M32, ahi >> _S32)
    b = (blo & _M32, blo >> _S32, bhi & _M32, bhi >> _S32)
    p00 = a[0] * b[0]
    p01, p10 = a[0] * b[1], a[1] * b[0]
    p02, p11, p20 = a[0] * b[2], a[1] * b[1], a[2] * b[0]
    low3 = (a[0] * b[3] + a[1] * b[2] + a[2] * b[1] + a[3] * b[0]) & _M32  # only its low word survives
    c1 = (p00 >> _S32) + (p01 & _M32) + (p10 & _M32)
    c2 = (p01 >> _S32) + (p10 >> _S32) + (p02 & _M32) + (p11 & _M32) + (p20 & _M32) + (c1 >> _S32)
    c3 = (p02 >> _S32) + (p11 >> _S32) + (p20 >> _S32) + low3 + (c2 >> _S32)
    lo = (p00 & _M32) | ((c1 & _M32) << _S32)
    hi = (c2 & _M32) | ((c3 & _M32) << _S32)
    return hi, lo


def _add128(ahi, alo, bhi, blo):
    lo = alo + blo
    carry = (lo < blo).astype(np.uint64)
    return ahi + bhi + carry, lo


def _split(values) -> tuple[np.ndarray, np.ndarray]:
    hi = np.array([v >> 64 for v in values], dtype=np.uint64)
    lo = np.array([v & ((1 << 64) - 1) for v in values], dtype=np.uint64)
    return hi, lo


_BLOCK = 1 << 13


@lru_cache(maxsize=1)
def _step_table() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(a_j, c_j) of f^j for j in 0.._BLOCK-1, as uint64 pairs."""
    aa, cc = [], []
    a, c = 1, 0
    for _ in range(_BLOCK):
        aa.append(a)
        cc.append(c)
        a, c = _compose((LCG_A, LCG_C), (a, c))
    return (*_split(aa), *_split(cc))


def rands(start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The random values of rows start..start+count-1 as (hi, lo) uint64 arrays."""
    if count <= 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    blocks = -(-count // _BLOCK)
    step = lcg_power(_BLOCK)
    x = rand_of_row(start)
    bases = []
    for _ in range(blocks):
        bases.append(x)
        x = (step[0] * x + step[1]) & MASK128
    bhi, blo = _split(bases)
    ahi, alo, chi, clo = _step_table()
    hi, lo = _mul128(ahi[None, :], alo[None, :], bhi[:, None], blo[:, None])
    hi, lo = _add128(hi, lo, chi[None, :], clo[None, :])
    return hi.reshape(-1)[:count], lo.reshape(-1)[:count]


_TEMPLATE = np.zeros(RECORD, dtype=np.uint8)
_TEMPLATE[10:12] = (0x00, 0x11)
_TEMPLATE[12:44] = ord("0")
_TEMPLATE[44:48] = (0x88, 0x99, 0xAA, 0xBB)
_TEMPLATE[96:100] = (0xCC, 0xDD, 0xEE, 0xFF)


def generate(start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """Records of rows start..start+count-1 as a (count, 100) uint8 array
    (written into `out` when given: e.g. a view of registered memory)."""
    if start < 0 or start + count > 1 << 64:
        raise ValueError("row ids must lie in 0..2**64-1")
    if out is None:
        out = np.empty((count, RECORD), dtype=np.uint8)
    elif out.shape != (count, RECORD) or out.dtype != np.uint8:
        raise ValueError(f"out must be uint8[{count}, {RECORD}], got {out.dtype}{list(out.shape)}")
    if count == 0:
        return out
    out[:] = _TEMPLATE
    hi, lo = rands(start, count)
    out[:, 0:8] = hi.astype(">u8").view(np.uint8).reshape(count, 8)
    out[:, 8:10] = (lo >> np.uint64(48)).astype(">u2").view(np.uint8).reshape(count, 2)
    rows = (
        np.arange(start, start + count, dtype=np.uint64)
        if start + count <= 1 << 63
        else np.array(range(start, start + count), dtype=np.uint64)
    )
    # the row id's high 64 bits are 0 (rows < 2**64): digits 12..27 stay '0'
    for k in range(16):
        out[:, 28 + k] = _HEX[(rows >> np.uint64(60 - 4 * k)) & np.uint64(15)]
    for k in range(12):
        digit = _HEX[(lo >> np.uint64(44 - 4 * k)) & np.uint64(15)]
        out[:, 48 + 4 * k : 52 + 4 * k] = digit[:, None]
    return out


# -- CRC-32 of every record, vectorised through the CRC's linearity --


@lru_cache(maxsize=2)
def _crc_tables(length: int) -> tuple[int, np.ndarray]:
    """crc32(m) = crc32(0^length) ^ XOR_k T[k][u16_k(m)] for messages of `length`
    bytes (even): T[k][v] is what the little-endian 16-bit word v at byte 2k adds."""
    zero = zlib.crc32(bytes(length))
    per_byte = np.zeros((length, 256), dtype=np.uint32)
    msg = bytearray(length)
    for i in range(length):
        for b in range(1, 256):
            msg[i] = b
            per_byte[i, b] = zlib.crc32(msg) ^ zero
        msg[i] = 0
    v = np.arange(1 << 16)
    words = per_byte[0::2][:, v & 0xFF] ^ per_byte[1::2][:, v >> 8]
    return zero, np.ascontiguousarray(words)


def crc32_rows(records: np.ndarray) -> np.ndarray:
    """zlib CRC-32 of each row of a (n, 100) uint8 array, as uint32[n]."""
    records = np.ascontiguousarray(records)
    n = records.shape[0]
    zero, table = _crc_tables(RECORD)
    acc = np.full(n, zero, dtype=np.uint32)
    if n == 0:
        return acc
    words = records.view(np.uint16).reshape(n, RECORD // 2)
    for k in range(RECORD // 2):
        acc ^= table[k][words[:, k]]
    return acc


def checksum(records: np.ndarray) -> int:
    """gensort -c / TeraGen CHECKSUM: the 128-bit sum of the records' CRC-32s."""
    return int(crc32_rows(records).astype(np.uint64).sum(dtype=np.uint64)) if len(records) else 0


def warm_up() -> None:
    """Computes the constant tables (LCG steps, CRC words) now rather than on first use."""
    _step_table()
    _crc_tables(RECORD)


def split_rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """(first row, row count) of part `index` of `parts`, as TeraGen splits rows
    among its mappers (part i ends at ceil(total * (i+1) / parts))."""
    begin = -(-total * index // parts)
    end = -(-total * (index + 1) // parts)
    return begin, end - begin


def keys_of(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 10-byte keys as (hi: uint64 of bytes 0-7, lo: uint16 of bytes 8-9),
    which compare like the bytes (unsigned, lexicographic)."""
    n = records.shape[0]
    hi = np.ascontiguousarray(records[:, 0:8]).view(">u8").reshape(n).astype(np.uint64)
    lo = np.ascontiguousarray(records[:, 8:10]).view(">u2").reshape(n).astype(np.uint16)
    return hi, lo


_ROW = np.dtype((np.void, RECORD))


def as_rows(records: np.ndarray) -> np.ndarray:
    """A (n, 100) uint8 array viewed as n opaque 100-byte items: gathers on it copy
    whole rows (memcpy) instead of 100 single bytes each, ~10x faster."""
    return np.ascontiguousarray(records).view(_ROW).reshape(records.shape[0])


def gather(records: np.ndarray, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """records[index] for (n, 100) uint8 records (into `out` when given)."""
    if out is None:
        out = np.empty((len(index), RECORD), dtype=np.uint8)
    if len(index):
        np.take(as_rows(records), index, out=as_rows(out))
    return out


def write_file(path: str, rows: int, start: int = 0, chunk: int = 1 << 20) -> int:
    """Writes rows start..start+rows-1 to `path` (what `gensort -b<start> <rows> <path>`
    writes); returns the checksum."""
    total = 0
    with open(path, "wb") as f:
        for s in range(start, start + rows, chunk):
            recs = generate(s, min(chunk, start + rows - s))
            total += checksum(recs)
            f.write(recs.tobytes())
    return total
