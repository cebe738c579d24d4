"""Peer processes for the tests (spawned with multiprocessing's "spawn" context).

Every function here runs in a child process: it builds its own Device, reports
{"address", "pid", ...} through the pipe, then serves until told to stop (or
until the pipe closes, or a bounded idle time passes), so a failed test never
leaves a process behind.
"""

from __future__ import annotations

import json
import os
import traceback
import zlib

import numpy as np

IDLE_LIMIT_S = 600.0  # a server that hears nothing for this long exits (EOF ends it at once)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (both sides can build the same ones)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def crc(buf) -> int:
    return zlib.crc32(memoryview(buf).cast("B"))


class GpuBytes:
    """A GPU block's bytes as the handlers below index them (numpy in, numpy
    out: the copies go through host memory, synchronised)."""

    def __init__(self, block) -> None:
        import torch

        self.torch = torch
        self.t = torch.from_dlpack(block)  # uint8, on the GPU, no copy

    def __getitem__(self, index):
        return self.t[index].cpu().numpy()

    def __setitem__(self, index, value) -> None:
        if np.isscalar(value):
            self.t[index] = int(value)
        else:
            self.t[index] = self.torch.from_numpy(np.ascontiguousarray(value)).to(self.t.device)
        self.torch.cuda.synchronize()


def serve(conn, transport: str, regions: dict, device_kwargs: dict | None = None) -> None:
    """Publishes one zeroed block per entry of `regions` (name -> bytes, or
    name -> (bytes, memory) for GPU memory: memory="cuda") and answers calls:

    - "checksum" {"name", "offset", "nbytes"} -> crc32 of that range (ascii)
    - "fill" {"name", "offset", "nbytes", "seed"} -> writes pattern(nbytes, seed) there
    - "zero" {"name"} -> zeroes the whole block
    - "unpublish" {"name"}
    - "boom" -> raises ValueError (error propagation)
    """
    import tensorwire as tw

    try:
        dev = tw.Device(transport=transport, **(device_kwargs or {}))
        views = {}
        blocks = {}
        for name, spec in regions.items():
            nbytes, memory = spec if isinstance(spec, (tuple, list)) else (spec, "host")
            blk = dev.alloc(int(nbytes), memory=memory)
            blocks[name] = blk
            views[name] = np.asarray(blk) if memory == "host" else GpuBytes(blk)
            dev.publish(name, blk)

        def checksum(payload: bytes) -> bytes:
            a = json.loads(payload)
            v = views[a["name"]][a["offset"] : a["offset"] + a["nbytes"]]
            return str(crc(v)).encode()

        def fill(payload: bytes) -> bytes:
            a = json.loads(payload)
            views[a["name"]][a["offset"] : a["offset"] + a["nbytes"]] = pattern(a["nbytes"], a["seed"])
            return b"ok"

        def zero(payload: bytes) -> bytes:
            views[json.loads(payload)["name"]][:] = 0
            return b"ok"

        def unpublish(payload: bytes) -> bytes:
            dev.unpublish(json.loads(payload)["name"])
            return b"ok"

        def boom(payload: bytes) -> bytes:
            raise ValueError("boom: " + payload.decode())

        for name, fn in [
            ("checksum", checksum),
            ("fill", fill),
            ("zero", zero),
            ("unpublish", unpublish),
            ("boom", boom),
        ]:
            dev.on_call(name, fn)
        conn.send({"address": dev.address, "pid": os.getpid(), "device_id": dev.id})
    except BaseException:  # report, so the test fails with the child's traceback
        conn.send({"error": traceback.format_exc()})
        return
    try:
        while conn.poll(IDLE_LIMIT_S):
            msg = conn.recv()
            if msg == "stop":
                break
            if msg == "stats":
                conn.send(dev.stats())
            elif msg == "peers":
                conn.send(dev.peers())
    except (EOFError, OSError):
        pass  # the test process went away
    finally:
        dev.close()
    try:
        conn.send("stopped")
    except OSError:
        pass


def refused_connects(conn, transport: str, rounds: int) -> None:
    """Connects `rounds` times to ports nobody listens on, each right after a
    lookup on a live peer (so the control thread is awake and applies the
    refusal at once). Reports {"rounds", "max_s", "errors"}; a hang here is
    caught by the parent's bounded wait (UCX 1.22 spins forever sending on a
    client-server endpoint that failed before it was wired up)."""
    import time

    import tensorwire as tw
    from tensorwire.ranks.launch import free_port

    try:
        conn.send({"address": None, "pid": os.getpid()})
        dev = tw.Device(transport=transport, connect_timeout=2)
        live = tw.Device(transport=transport)
        blk = live.alloc(64)
        live.publish("x", blk)
        ch = dev.connect(live.address)
        worst, errors = 0.0, {}
        for _ in range(rounds):
            port = free_port()
            ch.lookup("x")
            t0 = time.monotonic()
            try:
                dev.connect(f"127.0.0.1:{port}")
                errors["connected?!"] = errors.get("connected?!", 0) + 1
            except tw.Error as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            worst = max(worst, time.monotonic() - t0)
        ch.lookup("x")  # the device still works after all that
        dev.close()
        live.close()
        conn.send({"rounds": rounds, "max_s": worst, "errors": errors})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


# ---------------------------------------------------------------- tensor slots

# numpy dtype used to hold each tensorwire dtype's elements (bfloat16: raw words)
SLOT_NUMPY_DTYPES = {
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "bfloat16": "uint16",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
    "complex64": "complex64",
    "complex128": "complex128",
}


def slot_tensor(dtype: str, shape, seed: int) -> np.ndarray:
    """Deterministic contents of a tensor of `dtype` (a tensorwire name) and
    `shape`, as a numpy array (bfloat16 as raw uint16 words; bool as 0/1)."""
    shape = tuple(int(s) for s in shape)
    npdt = np.dtype(SLOT_NUMPY_DTYPES[dtype])
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.frombuffer(np.random.default_rng(seed).bytes(count * npdt.itemsize), dtype=np.uint8)
    if dtype == "bool":
        return (raw & 1).astype(np.bool_).reshape(shape)
    return raw.view(npdt).reshape(shape).copy()


def _received_item(arr: np.ndarray, mode: str, extra: dict) -> dict:
    if mode == "bytes":
        return {"shape": list(arr.shape), "dtype": arr.dtype.name, "data": arr.tobytes(), **extra}
    raise ValueError(f"unknown mode {mode!r}")


def _torch_item(slot, obj, is_static: bool) -> dict:
    import torch

    if is_static:
        t = torch.from_numpy(obj)  # the slot's numpy view (bfloat16: raw words)
        if slot.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        zero_copy = t.data_ptr() == obj.__array_interface__["data"][0]
    else:
        t = torch.from_dlpack(obj)  # the received Block, true dtype (bfloat16 included)
        zero_copy = t.numel() == 0 or t.data_ptr() == obj.ptr
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"shape": list(t.shape), "dtype": str(t.dtype), "data": data, "zero_copy": zero_copy}


def _gpu_item(obj) -> dict:
    """A tensor received into GPU memory, as its bytes (copied to the host) and where it was."""
    import torch

    t = torch.from_dlpack(obj)  # a GPU slot's view or a GPU Block: true dtype
    data = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
    return {"shape": list(t.shape), "dtype": str(t.dtype), "device": str(t.device), "data": data}


def _slot_recv(dev, slot, is_static: bool, a: dict) -> dict:
    """Receives a["count"] tensors from `slot` (see slot_peer)."""
    import time

    import tensorwire as tw

    count, timeout, mode = a.get("count", 1), a.get("timeout", 10.0), a.get("mode", "bytes")
    sleep = a.get("sleep", 0.0)
    out: dict = {"items": [], "values": [], "nonuniform": 0, "in_use": []}
    for _ in range(count):
        before = dev.stats()["bytes_in_use"]
        t0 = time.monotonic()
        try:
            obj = slot.recv(timeout=timeout)
        except tw.Error as e:
            out.update(
                raised=type(e).__name__,
                message=str(e),
                elapsed=time.monotonic() - t0,
                in_use_after_error=dev.stats()["bytes_in_use"],
                in_use_before_error=before,
            )
            break
        out["in_use"].append((before, dev.stats()["bytes_in_use"]))
        arr = None if mode == "gpu" else obj if is_static else obj.numpy()
        if mode == "gpu":
            out["items"].append(_gpu_item(obj))
        elif mode == "fill":  # every element holds the tensor's index
            flat = arr.reshape(-1)
            if flat.size == 0 or not (flat == flat[0]).all():
                out["nonuniform"] += 1
            out["values"].append(int(flat[0]) if flat.size else None)
        elif mode == "torch":
            out["items"].append(_torch_item(slot, obj, is_static))
        else:
            extra = {} if is_static else {"block_shape": list(obj.shape), "format": obj.format}
            out["items"].append(_received_item(arr, mode, extra))
        if sleep:
            time.sleep(sleep)
        if is_static:
            slot.release(obj)
        else:
            del arr
            obj.release()
    out["stats"] = slot.stats()
    out["next_seq"] = slot.next_seq
    out["bytes_in_use"] = dev.stats()["bytes_in_use"]
    return out


def _slot_send(dev, sender, a: dict) -> dict:
    """Sends a["count"] tensors filled with start+i (see slot_peer)."""
    import time

    import tensorwire as tw

    if a.get("delay"):
        time.sleep(a["delay"])
    shape, dtype = tuple(a.get("shape", (4,))), a.get("dtype", "int64")
    start, count, timeout = a.get("start", 0), a.get("count", 1), a.get("timeout", 10.0)
    out: dict = {"sent": 0}
    try:
        for i in range(count):
            arr = np.full(shape, start + i, dtype=SLOT_NUMPY_DTYPES[dtype])
            req = sender.send(arr, timeout=timeout)
            req.wait(timeout)
            out["sent"] += 1
    except tw.Error as e:
        out.update(raised=type(e).__name__, message=str(e))
    out["stats"] = sender.stats()
    return out


def slot_peer(conn, transport: str, device_kwargs: dict | None = None) -> None:
    """A device that holds tensor slots (receiver) or senders, driven by
    messages {"op": ...} through the pipe; every message gets one reply
    (a dict; {"error": traceback} for an unexpected failure):

    - "static_slot" {name, shape, dtype, depth=2, first_seq=1, memory="host"} / "dynamic_slot" {name,
      max_ndim, max_nbytes, memory="host"}
    - "drop" {name}: forgets a slot or sender
    - "recv" {name, count=1, timeout=10, mode="bytes"|"fill"|"torch"|"gpu", sleep=0}: receives `count`
      tensors (releasing each after `sleep` s); an error ends the loop and is
      reported as {"raised", "message", "elapsed", ...}
    - "poll" {name}: {"none": bool}
    - "next_seq" {name}, "stats" {name}, "device_stats"
    - "connect" {address}; "sender" {kind: "static"|"dynamic", name, path}
    - "send" {name, shape, dtype, start, count, delay}: np.full(shape, start+i) each, waited
    """
    slots: dict = {}
    senders: dict = {}
    channel = None

    def handle(dev, msg: dict) -> dict:
        nonlocal channel
        op = msg["op"]
        if op == "static_slot":
            s = dev.static_slot(
                msg["name"],
                tuple(msg["shape"]),
                msg["dtype"],
                depth=msg.get("depth", 2),
                first_seq=msg.get("first_seq", 1),
                memory=msg.get("memory", "host"),
            )
            slots[msg["name"]] = (s, True)
            reply = {"next_seq": s.next_seq}
        elif op == "dynamic_slot":
            s = dev.dynamic_slot(
                msg["name"],
                max_ndim=msg.get("max_ndim", 8),
                max_nbytes=msg.get("max_nbytes", 1 << 32),
                memory=msg.get("memory", "host"),
            )
            slots[msg["name"]] = (s, False)
            reply = {"next_seq": s.next_seq, "record_size": s.record_size}
        elif op == "drop":
            slots.pop(msg["name"], None)
            senders.pop(msg["name"], None)
            reply = {}
        elif op == "recv":
            s, is_static = slots[msg["name"]]
            reply = _slot_recv(dev, s, is_static, msg)
        elif op == "poll":
            s, is_static = slots[msg["name"]]
            got = s.poll()
            reply = {"none": got is None}
            if got is not None:
                if is_static:
                    s.release(got)
                else:
                    got.release()
        elif op == "next_seq":
            reply = {"next_seq": slots[msg["name"]][0].next_seq}
        elif op == "stats":
            reply = {"stats": slots[msg["name"]][0].stats()}
        elif op == "device_stats":
            reply = {"stats": dev.stats()}
        elif op == "connect":
            channel = dev.connect(msg["address"])
            reply = {}
        elif op == "sender":
            make = channel.static_sender if msg["kind"] == "static" else channel.dynamic_sender
            senders[msg["name"]] = make(msg["name"], path=msg.get("path", "copy"))
            reply = {}
        elif op == "send":
            reply = _slot_send(dev, senders[msg["name"]], msg)
        else:
            raise ValueError(f"unknown op {op!r}")
        return reply

    def forget() -> None:
        slots.clear()
        senders.clear()

    run_device_peer(conn, transport, device_kwargs, handle, forget)


def run_device_peer(conn, transport: str, device_kwargs: dict | None, handle, forget, setup=None) -> None:
    """The body of a peer process driven through `conn`: makes a device, runs
    setup(dev) if given, sends its address, answers each {"op": ...} message
    with handle(dev, msg) (a dict; {"error": traceback} when it raises) until
    "stop", EOF or an idle limit, then forget()s what it holds and closes the
    device."""
    import tensorwire as tw

    try:
        dev = tw.Device(transport=transport, **(device_kwargs or {}))
        if setup is not None:
            setup(dev)
        conn.send({"address": dev.address, "pid": os.getpid(), "device_id": dev.id})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        return
    try:
        while conn.poll(IDLE_LIMIT_S):
            msg = conn.recv()
            if msg == "stop":
                break
            try:
                reply = handle(dev, msg)
            except BaseException:
                reply = {"error": traceback.format_exc()}
            conn.send(reply)
    except (EOFError, OSError):
        pass
    finally:
        forget()
        dev.close()
    try:
        conn.send("stopped")
    except OSError:
        pass


def notify_target(conn, transport: str, count: int, size: int, timeout: float = 60.0) -> None:
    """Publishes "region" (count * size bytes), reports its address, then takes `count` notifications (each the decimal
    index k of a write of pattern(size, k) at offset k * size) and checks, as
    each arrives, that its data is already there. Reports {"got": [k...],
    "late_data": [k...], "senders": [...]}."""
    import time

    import tensorwire as tw

    try:
        dev = tw.Device(transport=transport)
        region = dev.alloc(count * size)
        view = np.asarray(region)
        dev.publish("region", region)
        conn.send({"address": dev.address, "pid": os.getpid(), "device_id": dev.id})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        return
    got, late, senders = [], [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(got) < count and time.monotonic() < deadline:
            for peer, message in dev.notifications():
                k = int(message.decode())
                senders.add(peer)
                got.append(k)
                if crc(view[k * size : (k + 1) * size]) != crc(pattern(size, k)):
                    late.append(k)
            time.sleep(0.0005)
        time.sleep(0.2)  # anything more (a duplicate) would arrive now
        for peer, message in dev.notifications():
            got.append(int(message.decode()))
        conn.send({"got": got, "late_data": late, "senders": sorted(senders)})
        conn.poll(IDLE_LIMIT_S)
    except (EOFError, OSError):
        pass
    finally:
        dev.close()


def quiet_target(conn, transport: str, size: int) -> None:
    """Publishes "region" (size bytes, zeroed) and reports its address without
    ever looking at its notifications, until asked {"take": n}: then it takes
    n of them (waiting up to 20 s) and answers {"got": [[sender, text]...],
    "data": the first n bytes of region as seen then, "again": what a second
    look 0.2 s later finds}."""
    import asyncio
    import time

    view = None

    def setup(dev) -> None:
        nonlocal view
        region = dev.alloc(size)
        view = np.asarray(region)
        view[:] = 0
        dev.publish("region", region)

    def handle(dev, msg) -> dict:
        n = msg["take"]
        got = []
        while len(got) < n:
            got.append(asyncio.run(dev.next_notification(timeout=20)))
        data = [int(b) for b in view[:n]]
        time.sleep(0.2)
        return {"got": [[peer, m.decode()] for peer, m in got], "data": data, "again": dev.notifications()}

    run_device_peer(conn, transport, None, handle, lambda: None, setup)
