"""GPU memory end to end (issue 20): CUDA blocks and registrations, write/read
between host and GPU memory of two processes, the errors a user can make.

Every test needs a CUDA GPU and torch with CUDA; without them the module
skips with the reason. Over "shm" same-host GPU to GPU goes over cuda_ipc;
over "tcp" UCX stages GPU memory through host memory (cuda_copy).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import tensorwire as tw
from _peers import crc, pattern
from conftest import call_json, remote_crc, start_server, start_slot_peer

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not tw.cuda_available():
    pytest.skip(f"tensorwire sees no GPU: {tw.cuda_info()['reason']}", allow_module_level=True)

pytestmark = pytest.mark.gpu

MiB = 1 << 20
REGION = 256 * MiB
SIZES = [1, 4096, 1 * MiB + 3, 16 * MiB, 256 * MiB]
MEMORIES = ["host", "cuda"]


def test_cuda_block_is_a_cuda_tensor_without_copy():
    with tw.Device() as dev:
        block = dev.empty((64, 32), "float32", memory="cuda")
        assert block.memory == "cuda:0"
        assert block.__dlpack_device__() == (2, 0)
        t = torch.from_dlpack(block)
        assert t.is_cuda and t.shape == (64, 32) and t.dtype == torch.float32
        assert t.data_ptr() == block.ptr
        t.fill_(3.0)
        torch.cuda.synchronize()
        assert float(torch.from_dlpack(block).sum()) == 3.0 * 64 * 32
        with pytest.raises(BufferError, match="GPU memory"):
            memoryview(block)  # the buffer protocol would let the CPU dereference GPU memory
        with pytest.raises(tw.InvalidArgument, match="GPU memory"):
            block.numpy()
        assert dev.alloc(10, memory="cuda:0").memory == "cuda:0"


def test_registration_of_one_segment_is_one_registration():
    with tw.Device() as dev:
        base = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        before = dev.stats()
        regs = [dev.register(base[i * MiB : (i + 1) * MiB]) for i in range(8)]
        after = dev.stats()
        assert all(r.memory == "cuda:0" for r in regs)
        assert after["registration_cache_misses"] - before["registration_cache_misses"] == 1
        assert after["registration_cache_hits"] - before["registration_cache_hits"] == 7


def test_bad_gpu_memory_gets_clear_errors():
    with tw.Device() as dev:
        with pytest.raises(tw.InvalidArgument, match="no GPU 7"):
            dev.empty((4,), memory="cuda:7")
        with pytest.raises(tw.InvalidArgument, match="memory must be"):
            dev.empty((4,), memory="gpu")
        t = torch.zeros((64, 64), device="cuda")
        with pytest.raises(tw.InvalidArgument, match="contiguous"):
            dev.register(t.t())
        # A freed allocation: its own segment (large), returned to the driver.
        gone = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        ptr = gone.data_ptr()
        del gone
        torch.cuda.empty_cache()
        with pytest.raises(tw.InvalidArgument, match="not live GPU memory"):
            dev.register_memory(ptr, 4096, True)
        live = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        with pytest.raises(tw.InvalidArgument, match="runs past its GPU allocation"):
            dev.register_memory(live.data_ptr(), 1 << 40, True)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def server(request):
    regions = {"host": REGION, "cuda": (REGION, "cuda")}
    with start_server(request.param, regions, workers=2) as peer:
        peer.transport = request.param
        yield peer


def _local(dev, nbytes, memory):
    """A local region of `memory` and a way to put numpy bytes in and take them out."""
    if memory == "host":
        block = dev.alloc(nbytes)
        view = np.asarray(block)

        def put(data):
            view[: len(data)] = data

        return block, put, lambda n: view[:n].copy()
    t = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    reg = dev.register(t)  # a torch tensor, registered where it is

    def put_gpu(data):
        t[: len(data)] = torch.from_numpy(data.copy()).cuda()
        torch.cuda.synchronize()  # the stream contract: the bytes are written before the transfer reads them

    return reg, put_gpu, lambda n: t[:n].cpu().numpy()


@pytest.mark.parametrize("remote_memory", MEMORIES)
@pytest.mark.parametrize("local_memory", MEMORIES)
def test_write_and_read_every_pair(server, local_memory, remote_memory):
    with tw.Device(transport=server.transport) as dev:
        ch = dev.connect(server.address)
        remote = ch.lookup(remote_memory)
        assert remote.memory == remote_memory
        src, put, _ = _local(dev, REGION, local_memory)
        dst, _, take = _local(dev, REGION, local_memory)
        for size in SIZES:
            offset = 0 if size == REGION else 4099
            data = pattern(size, seed=size)
            put(data)
            ch.write(src, remote, remote_offset=offset, nbytes=size).wait(60)
            ch.flush().wait(60)
            assert remote_crc(ch, remote_memory, offset, size) == crc(data), (size, server.transport)
            call_json(ch, "fill", name=remote_memory, offset=offset, nbytes=size, seed=size + 1)
            ch.read(dst, remote, remote_offset=offset, nbytes=size).wait(60)
            assert crc(take(size)) == crc(pattern(size, seed=size + 1)), (size, server.transport)


def test_dead_peer_fails_pending_gpu_transfers():
    with start_server("shm", {"cuda": (64 * MiB, "cuda")}) as peer, tw.Device(transport="shm", liveness=2.0) as dev:
        ch = dev.connect(peer.address)
        remote = ch.lookup("cuda")
        src = dev.alloc(64 * MiB, memory="cuda")
        ch.write(src, remote).wait(30)
        peer.kill()
        killed = time.monotonic()
        with pytest.raises((tw.PeerFailed, tw.ConnectionError)):
            for _ in range(1000):  # bounded: the peer's failure ends it long before
                ch.write(src, remote).wait(30)
        assert time.monotonic() - killed < 15.0


DTYPES = list(tw.DTYPE_TABLE)


def _random_tensor(shape, dtype: str):
    """A CUDA tensor of `dtype` with random bytes (bool: 0 or 1, as torch requires)."""
    if dtype == "bool":
        return torch.randint(0, 2, shape, device="cuda").bool()
    tdtype = getattr(torch, dtype)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=tdtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    return raw.view(tdtype).reshape(shape)


def _bytes_of(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


@pytest.fixture(scope="module", params=["shm", "tcp"])
def gpu_receiver(request):
    with start_slot_peer(request.param) as peer:
        peer.transport = request.param
        yield peer


@pytest.mark.parametrize("path", ["block", "copy", "register"])
def test_static_gpu_slot_every_dtype(gpu_receiver, path):
    """Static slots with GPU payloads (sequence words in host memory): every dtype,
    from a CUDA Block (zero copy), or a torch CUDA tensor copied or registered."""
    with tw.Device(transport=gpu_receiver.transport) as dev:
        ch = dev.connect(gpu_receiver.address)
        for dtype in DTYPES:
            name = f"s-{path}-{dtype}"
            shape = (17, 3)
            # depth 3: the three sends below complete before the receiver takes any
            gpu_receiver.request(
                {"op": "static_slot", "name": name, "shape": shape, "dtype": dtype, "depth": 3, "memory": "cuda"}
            )
            sender = ch.static_sender(name, path="copy" if path == "block" else path)
            sent = []
            for i in range(3):
                t = _random_tensor(shape, dtype)
                if path == "block":
                    block = dev.empty(shape, dtype, memory="cuda")
                    torch.from_dlpack(block).copy_(t)
                    torch.cuda.synchronize()  # the stream contract for a Block: the caller's
                    sender.send(block).wait(30)
                else:
                    sender.send(t).wait(30)
                sent.append(_bytes_of(t))
            got = gpu_receiver.request({"op": "recv", "name": name, "count": 3, "mode": "gpu"}, timeout=60)
            assert "raised" not in got, got
            assert [item["data"] for item in got["items"]] == sent, (dtype, path)
            assert all(item["device"] == "cuda:0" for item in got["items"])
            stats = sender.stats()
            assert stats["zero_copy" if path == "block" else {"copy": "copies", "register": "registrations"}[path]] == 3
            gpu_receiver.request({"op": "drop", "name": name})


@pytest.mark.parametrize("path", ["copy", "register"])
def test_dynamic_gpu_slot_every_dtype(gpu_receiver, path):
    """Dynamic slots allocating in the receiver's CUDA arena, reading from GPU memory."""
    with tw.Device(transport=gpu_receiver.transport) as dev:
        ch = dev.connect(gpu_receiver.address)
        name = f"d-{path}"
        gpu_receiver.request({"op": "dynamic_slot", "name": name, "memory": "cuda"})
        sender = ch.dynamic_sender(name, path=path)
        sent = []
        for i, dtype in enumerate(DTYPES):
            t = _random_tensor((5 + i, 7), dtype)
            req = sender.send(t)
            got = gpu_receiver.request({"op": "recv", "name": name, "count": 1, "mode": "gpu"}, timeout=60)
            req.wait(30)
            assert "raised" not in got, got
            item = got["items"][0]
            assert item["data"] == _bytes_of(t) and item["shape"] == [5 + i, 7], dtype
            assert item["device"] == "cuda:0"
            sent.append(dtype)
        assert sender.stats()["copies" if path == "copy" else "registrations"] == len(DTYPES)
