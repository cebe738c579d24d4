"""Rank side of test_torch_dist.py: every op x dtype on one backend; each rank saves
what it got (or the error's type) to OUT/rank<r>.pt for the test to compare with gloo."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import tensorwire.torch  # noqa: F401 - registers "tensorwire"

backend, out_dir = sys.argv[1], sys.argv[2]
dist.init_process_group(backend, timeout=timedelta(seconds=60))
r, n = dist.get_rank(), dist.get_world_size()
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
results: dict = {}


def val(count: int, dt: torch.dtype, rank: int = r, salt: int = 0) -> torch.Tensor:
    """Small integers (exact in every dtype, sums and products included)."""
    return ((torch.arange(count) * 7 + rank * 3 + salt) % 5 + 1).to(dt)


def record(key: str, fn) -> None:
    try:
        results[key] = fn()
    except Exception as e:  # noqa: BLE001 - the test compares error kinds too
        results[key] = f"error: {type(e).__name__}: {e}"


for dt in DTYPES:
    d = str(dt).split(".")[1]
    for count in (5, 70_000, 600_001):  # eager and placed messages; all_reduce >= 1 MiB by messages
        for name, op in OPS.items():
            if name == "avg" and backend == "gloo":
                continue  # gloo has no AVG: the test derives it from its sum
            def ar(op=op):
                t = val(count, dt)
                dist.all_reduce(t, op=op)
                return t
            record(f"all_reduce/{name}/{d}/{count}", ar)
        if count > 70_000:
            continue

        def bc():
            t = val(count, dt)
            dist.broadcast(t, src=n - 1)
            return t
        record(f"broadcast/{d}/{count}", bc)

        def red():
            t = val(count, dt)
            dist.reduce(t, dst=0)
            return t if r == 0 else None
        record(f"reduce/{d}/{count}", red)

        def ag():
            outs = [torch.empty(count, dtype=dt) for _ in range(n)]
            dist.all_gather(outs, val(count, dt))
            return torch.stack(outs)
        record(f"all_gather/{d}/{count}", ag)

        def agt():
            out = torch.empty(n * count, dtype=dt)
            dist.all_gather_into_tensor(out, val(count, dt))
            return out
        record(f"all_gather_into_tensor/{d}/{count}", agt)

        def rs():
            out = torch.empty(count, dtype=dt)
            dist.reduce_scatter(out, [val(count, dt, salt=p) for p in range(n)])
            return out
        record(f"reduce_scatter/{d}/{count}", rs)

        def rst():
            out = torch.empty(count, dtype=dt)
            dist.reduce_scatter_tensor(out, val(n * count, dt))
            return out
        record(f"reduce_scatter_tensor/{d}/{count}", rst)

        def a2a():
            outs = [torch.empty(count, dtype=dt) for _ in range(n)]
            dist.all_to_all(outs, [val(count, dt, salt=p) for p in range(n)])
            return torch.stack(outs)
        record(f"all_to_all/{d}/{count}", a2a)

        def a2as():
            out = torch.empty(n * count, dtype=dt)
            dist.all_to_all_single(out, val(n * count, dt))
            return out
        record(f"all_to_all_single/{d}/{count}", a2as)

        def a2au():  # uneven: rank r sends (p + 1) * (r + 1) rows to rank p
            ins = [(p + 1) * (r + 1) for p in range(n)]
            outs = [(r + 1) * (p + 1) for p in range(n)]
            x = val(sum(ins) * 3, dt).reshape(-1, 3)
            y = torch.empty(sum(outs), 3, dtype=dt)
            dist.all_to_all_single(y, x, outs, ins)
            return y
        record(f"all_to_all_single_uneven/{d}/{count}", a2au)

        def ga():
            outs = [torch.empty(count, dtype=dt) for _ in range(n)] if r == 0 else None
            dist.gather(val(count, dt), outs, dst=0)
            return torch.stack(outs) if r == 0 else None
        record(f"gather/{d}/{count}", ga)

        def sc():
            out = torch.empty(count, dtype=dt)
            dist.scatter(out, [val(count, dt, salt=p) for p in range(n)] if r == n - 1 else None, src=n - 1)
            return out
        record(f"scatter/{d}/{count}", sc)

        if n > 1:
            def ring():  # send to the right, receive from the left, two tags, any order of posting
                right, left = (r + 1) % n, (r - 1) % n
                a, b = torch.empty(count, dtype=dt), torch.empty(count, dtype=dt)
                ops = [dist.P2POp(dist.irecv, b, left, tag=2), dist.P2POp(dist.irecv, a, left, tag=1),
                       dist.P2POp(dist.isend, val(count, dt, salt=1), right, tag=1),
                       dist.P2POp(dist.isend, val(count, dt, salt=2), right, tag=2)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                return torch.stack([a, b])
            record(f"p2p_ring/{d}/{count}", ring)

dist.barrier()
if n > 1:  # many outstanding messages of one tag: delivered in order
    def many():
        if r == 0:
            works = [dist.isend(torch.full((k % 3 * 20_000 + 1,), k, dtype=torch.int64), 1, tag=9) for k in range(100)]
            for w in works:
                w.wait()
            return None
        bufs = [torch.empty(k % 3 * 20_000 + 1, dtype=torch.int64) for k in range(100)]
        works = [dist.irecv(b, 0, tag=9) for b in bufs] if r == 1 else []
        for w in works:
            w.wait()
        return torch.stack([b[0] for b in bufs]) if r == 1 else None
    record("many_outstanding", many)
dist.barrier()
torch.save(results, os.path.join(out_dir, f"rank{r}.pt"))
dist.destroy_process_group()
print(f"rank {r}: {len(results)} results")
