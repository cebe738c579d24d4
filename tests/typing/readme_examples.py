"""The README's examples, typed as a user's program would be: `mypy --strict`
must accept this file against tensorwire's stubs (make lint). It also runs
(tests/python/project/test_typing.py executes it), so the examples stay true."""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt

import tensorwire as tw


def quick_start() -> None:
    with tw.Device() as server, tw.Device() as client:
        dst = server.empty((1024, 1024), "float32")
        server.publish("weights", dst)
        src = client.empty((1024, 1024), "float32")
        np.asarray(src)[:] = 1.0
        ch = client.connect(server.address)
        remote = ch.lookup("weights")
        ch.write(src, remote).wait(timeout=5)
        ch.flush().wait(timeout=5)
        assert (np.asarray(dst) == 1.0).all()


def slots() -> None:
    with tw.Device() as receiver, tw.Device() as client:
        ch = client.connect(receiver.address)
        slot = receiver.static_slot("grad", (4, 4), "float32", depth=2)
        sender = ch.static_sender("grad")
        block = client.empty((4, 4), "float32")
        np.asarray(block)[:] = 2.0
        sender.send(block).wait()
        view: npt.NDArray[np.float32] = slot.recv(timeout=5)
        assert float(view.sum()) == 32.0
        slot.release(view)

        dslot = receiver.dynamic_slot("sparse")
        dsender = ch.dynamic_sender("sparse")
        request = dsender.send(np.arange(6, dtype=np.int64))
        index = tw.wait_any([dslot, request], timeout=5)
        assert index == 0
        got = dslot.recv(timeout=5)
        assert list(np.asarray(got)) == list(range(6))
        request.wait(5)

        async def receive() -> tw.Block:
            dsender.send(np.ones(3, dtype=np.float32))
            return await dslot.recv_async(timeout=5)

        assert np.asarray(asyncio.run(receive())).sum() == 3.0


if __name__ == "__main__":
    quick_start()
    slots()
    print("ok")
