"""Tensors whose storage gives its memory back after the backend moved them (FSDP2's
storage.resize_(0), then resize_ again): nothing refuses the resize, and the next message from
or into the reallocated memory carries the new bytes. (That a registration of unmapped memory
is not reused is tests/cpp/loopback/test_messenger.cc's ARegistrationOfUnmappedMemoryIsNotReused:
whether glibc unmaps a freed block is its choice.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import tensorwire_run  # noqa: E402
from test_torch_dist import script  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_resized_storage_is_moved_again_with_its_new_bytes(transport: str, tmp_path: Path) -> None:
    prog = script(
        tmp_path,
        """
        dist.init_process_group("tensorwire")
        r = dist.get_rank()
        n = (2 << 20) // 4  # a placed message (above the eager size)
        t = torch.full((n,), 1.0)
        for round in range(4):
            if r == 0:
                t.fill_(round + 1.0)
                dist.send(t, 1)
            else:
                dist.recv(t, 0)
                assert t.min().item() == t.max().item() == round + 1.0, (round, t.min().item(), t.max().item())
            dist.barrier()
            nbytes = t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)       # the memory goes back, as FSDP2 frees a parameter
            t.untyped_storage().resize_(nbytes)  # and comes again, maybe at the same address
        say("rank", r, "moved 4 tensors")
        dist.destroy_process_group()
    """,
    )
    run = tensorwire_run(2, prog, env={"TENSORWIRE_TRANSPORT": transport})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("moved 4 tensors") == 2, run.stdout
