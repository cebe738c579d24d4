"""Attacker-side helpers of test_isolation.py (issue 16: a peer reaches only
what was exported to it).

Wire forms forged here:

- region descriptor (docs/contracts.md §9.1, cpp/src/core/region.cc):
  u32 magic | u8 version | u8 memory type | u16 0 | u64 device id | u64 address | u64 length | u32 rkey length | rkey
- dynamic-slot record (docs/contracts.md §10.4, cpp/src/protocol/dynamic_record.h):
  u32 magic "TWDR" | u16 version | u8 dtype code | u8 bits | u32 ndim | u32 rkey length | u64 nbytes |
  u64 address | u64 device id | i64 dims[max_ndim] | rkey; the u64 sequence at record_size - 64.

`forger` runs in a spawned process (see conftest.PeerProcess): a device that
connects, looks up, allocates and *exports* whatever it is told, through the
built-in "tw.export" call any peer may make about its own memory.
"""

from __future__ import annotations

import struct

import numpy as np

from _peers import run_device_peer

DESCRIPTOR_MAGIC = 0x44525754  # "TWRD"
RECORD_MAGIC = 0x52445754  # "TWDR"
EXPORT_CALL = "tw.export"  # cpp/src/core/control_wire.h kExportCall
_DESC_HEAD = struct.Struct("<IBBHQQQI")  # 36 bytes


def parse_descriptor(raw: bytes) -> dict:
    """The fields of a descriptor, rkey bytes included (tw.parse_descriptor leaves them out)."""
    magic, version, mem, _, dev, addr, length, rkey_len = _DESC_HEAD.unpack_from(raw)
    assert magic == DESCRIPTOR_MAGIC and len(raw) == _DESC_HEAD.size + rkey_len, raw
    return {
        "device_id": dev,
        "address": addr,
        "nbytes": length,
        "rkey": bytes(raw[36 : 36 + rkey_len]),
        "version": version,
        "memory_type": mem,
    }


def make_descriptor(device_id: int, address: int, nbytes: int, rkey: bytes) -> bytes:
    return _DESC_HEAD.pack(DESCRIPTOR_MAGIC, 1, 0, 0, device_id, address, nbytes, len(rkey)) + bytes(rkey)


def forge(raw: bytes, **fields) -> bytes:
    """A copy of descriptor `raw` with some fields replaced (device_id, address, nbytes, rkey)."""
    d = parse_descriptor(raw)
    d.update(fields)
    return make_descriptor(d["device_id"], d["address"], d["nbytes"], d["rkey"])


def record_body(
    max_ndim: int, shape, code: int, bits: int, nbytes: int, address: int, device_id: int, rkey: bytes
) -> bytes:
    """The bytes of a dynamic-slot record up to its rkey (what the sender writes before the sequence word)."""
    body = bytearray(40 + 8 * max_ndim)
    struct.pack_into(
        "<IHBBIIQQQ", body, 0, RECORD_MAGIC, 1, code, bits, len(shape), len(rkey), nbytes, address, device_id
    )
    for i, d in enumerate(shape):
        struct.pack_into("<q", body, 40 + 8 * i, int(d))
    return bytes(body) + bytes(rkey)


def attach_payload(ack_descriptor: bytes, sink: int = 0) -> bytes:
    """A slot attach call's payload: bytes32(descriptor of the sender's ack
    block), u64 the sender's message sink (contracts §10.2)."""
    return struct.pack("<I", len(ack_descriptor)) + ack_descriptor + struct.pack("<Q", sink)


def forger(conn, transport: str, device_kwargs: dict | None = None) -> None:
    """A device driven by {"op": ...} messages; every message gets one reply
    (a dict; {"error": traceback} for an unexpected failure):

    - "connect" {address}: a channel to that device (kept by address)
    - "lookup" {address, name}: {"descriptor": bytes}
    - "export" {address, descriptor}: calls tw.export on that peer with the
      (possibly forged) descriptor; {} or {"raised", "message"}
    - "alloc" {nbytes, fill}: a block kept alive; {"descriptor", "ptr"}
    """
    import tensorwire as tw

    channels: dict = {}
    blocks: list = []

    def handle(dev, msg: dict) -> dict:
        op = msg["op"]
        if op == "connect":
            channels[msg["address"]] = dev.connect(msg["address"])
            reply = {}
        elif op == "lookup":
            reply = {"descriptor": channels[msg["address"]].lookup(msg["name"]).descriptor()}
        elif op == "export":
            try:
                channels[msg["address"]].call(EXPORT_CALL, msg["descriptor"], 10.0)
                reply = {}
            except tw.Error as e:
                reply = {"raised": type(e).__name__, "message": str(e)}
        elif op == "alloc":
            blk = dev.alloc(int(msg["nbytes"]))
            np.asarray(blk)[:] = msg.get("fill", 0)
            blocks.append(blk)
            reply = {"descriptor": blk.descriptor(), "ptr": blk.ptr}
        else:
            raise ValueError(f"unknown op {op!r}")
        return reply

    def forget() -> None:
        channels.clear()
        blocks.clear()

    run_device_peer(conn, transport, device_kwargs, handle, forget)
