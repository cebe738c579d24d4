"""Point to point: send/recv, isend/irecv and batch_isend_irecv around a ring of ranks, small
and large tensors (small ones travel inline, large ones land straight in the receiver's tensor).

    torchrun --nproc-per-node 3 examples/p2p.py [--backend gloo]
"""

import argparse

import torch
import torch.distributed as dist

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend

p = argparse.ArgumentParser()
p.add_argument("--backend", default="tensorwire")
args = p.parse_args()
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % world, (rank - 1) % world
ok = True
for n in (10, 1_000_000):
    # blocking: even ranks send first, odd ranks receive first
    out, got = torch.full((n,), float(rank)), torch.empty(n)
    if rank % 2 == 0:
        dist.send(out, right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(out, right)
    ok &= bool((got == left).all())
    # non-blocking, with tags
    a, b = torch.empty(n), torch.empty(n)
    works = [dist.irecv(a, left, tag=1), dist.irecv(b, left, tag=2),
             dist.isend(out + 100, right, tag=2), dist.isend(out + 200, right, tag=1)]
    for w in works:
        w.wait()
    ok &= bool((a == left + 200).all() and (b == left + 100).all())
    # batched
    c = torch.empty(n, dtype=torch.int64)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((n,), rank, dtype=torch.int64), right),
                                     dist.P2POp(dist.irecv, c, left)]):
        w.wait()
    ok &= bool((c == left).all())
print(f"rank {rank}/{world} {args.backend}: p2p {'OK' if ok else 'WRONG'}", flush=True)
dist.destroy_process_group()
