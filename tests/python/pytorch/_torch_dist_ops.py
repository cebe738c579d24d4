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
OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}
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
                ops = [
                    dist.P2POp(dist.irecv, b, left, tag=2),
                    dist.P2POp(dist.irecv, a, left, tag=1),
                    dist.P2POp(dist.isend, val(count, dt, salt=1), right, tag=1),
                    dist.P2POp(dist.isend, val(count, dt, salt=2), right, tag=2),
                ]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                return torch.stack([a, b])

            record(f"p2p_ring/{d}/{count}", ring)

# Every other dtype gloo reduces, with the bitwise ops (what gloo refuses is not compared)
BITS = {**OPS, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def mixed(count: int, dt: torch.dtype, rank: int = r, salt: int = 0) -> torch.Tensor:
    """val(), but bool as a mix of True and False."""
    if dt == torch.bool:
        return (torch.arange(count) * 7 + rank * 3 + salt) % 3 == 0
    return val(count, dt, rank, salt)


for dt in (torch.float64, torch.int8, torch.int16, torch.int32, torch.bool, torch.complex64, torch.complex128):
    d = str(dt).split(".")[1]
    for count in (5, 70_000):
        for name, op in BITS.items():
            if name == "avg" and backend == "gloo":
                continue

            def ar2(op=op):
                t = mixed(count, dt)
                dist.all_reduce(t, op=op)
                return t

            record(f"all_reduce/{name}/{d}/{count}", ar2)

        def bc2():
            t = mixed(count, dt)
            dist.broadcast(t, src=n - 1)
            return t

        record(f"broadcast/{d}/{count}", bc2)

        def ag2():
            outs = [torch.empty(count, dtype=dt) for _ in range(n)]
            dist.all_gather(outs, mixed(count, dt))
            return torch.stack(outs)

        record(f"all_gather/{d}/{count}", ag2)

# Non-contiguous inputs and outputs (copied in and out), tensors reduced again, zero-size tensors
for dt in (torch.float32, torch.int64, torch.bfloat16, torch.int8):
    d = str(dt).split(".")[1]
    count = 1000

    def nc(count: int = count, dt: torch.dtype = dt, salt: int = 0) -> torch.Tensor:
        return val(2 * count, dt, salt=salt).reshape(2, count).t()  # (count, 2), not contiguous

    def nc_ar():
        t = nc()
        dist.all_reduce(t)
        return t.contiguous()

    record(f"nc/all_reduce/{d}", nc_ar)

    def nc_bc():
        t = nc()
        dist.broadcast(t, src=0)
        return t.contiguous()

    record(f"nc/broadcast/{d}", nc_bc)

    def nc_red():  # (gloo's non-roots get partial sums in a non-contiguous tensor: only the root compares)
        t = nc()
        dist.reduce(t, dst=n - 1)
        return t.contiguous() if r == n - 1 else None

    record(f"nc/reduce/{d}", nc_red)

    def red_kept():  # gloo (2.13) leaves partial results in the non-roots' tensors; tensorwire leaves them as they were
        t = val(count, dt)
        dist.reduce(t, dst=n - 1)
        return t if r == n - 1 else torch.tensor(torch.equal(t, val(count, dt)))

    if backend == "tensorwire":
        record(f"reduce_kept/{d}", red_kept)

    def nc_ag():
        outs = [torch.empty(2, count, dtype=dt).t() for _ in range(n)]
        dist.all_gather(outs, nc())
        return torch.stack([o.contiguous() for o in outs])

    record(f"nc/all_gather/{d}", nc_ag)

    def nc_rs():
        out = torch.empty(2, count, dtype=dt).t()
        dist.reduce_scatter(out, [nc(salt=p) for p in range(n)])
        return out.contiguous()

    record(f"nc/reduce_scatter/{d}", nc_rs)

    def nc_rst():
        out = torch.empty(2, count, dtype=dt).t()
        dist.reduce_scatter_tensor(out, val(2 * n * count, dt).reshape(n * count, 2))
        return out.contiguous()

    record(f"nc/reduce_scatter_tensor/{d}", nc_rst)

    def nc_agt():
        out = torch.empty(2, n * count, dtype=dt).t()
        dist.all_gather_into_tensor(out, nc())
        return out.contiguous()

    record(f"nc/all_gather_into_tensor/{d}", nc_agt)

    def nc_sc():
        out = torch.empty(2, count, dtype=dt).t()
        dist.scatter(out, [nc(salt=p) for p in range(n)] if r == 0 else None, src=0)
        return out.contiguous()

    record(f"nc/scatter/{d}", nc_sc)

    def nc_a2a():
        outs = [torch.empty(2, count, dtype=dt).t() for _ in range(n)]
        dist.all_to_all(outs, [nc(salt=p) for p in range(n)])
        return torch.stack([o.contiguous() for o in outs])

    record(f"nc/all_to_all/{d}", nc_a2a)

    def again():  # the same tensors reduced and gathered twice
        t = val(70_000, dt)
        outs = [torch.empty(70_000, dtype=dt) for _ in range(n)]
        got = []
        for k in range(2):
            t.copy_(val(70_000, dt, salt=k))
            dist.all_reduce(t)
            dist.all_gather(outs, t)
            got.append(torch.stack(outs))
        return torch.stack(got)

    record(f"again/{d}", again)

    def empty():
        t = torch.empty(0, dtype=dt)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        outs = [torch.empty(0, dtype=dt) for _ in range(n)]
        dist.all_gather(outs, t)
        return torch.stack(outs)

    record(f"empty/{d}", empty)

    def coalesced():
        a, b = val(5, dt), val(7, dt, salt=1)
        dist.all_reduce_coalesced([a, b])
        outs = [[torch.empty(5, dtype=dt), torch.empty(7, dtype=dt)] for _ in range(n)]
        dist.all_gather_coalesced(outs, [a, b])
        return torch.cat([torch.cat(o) for o in outs])

    record(f"coalesced/{d}", coalesced)

if n > 1:  # any source: rank 0 receives one message from every other rank, in whatever order they come

    def any_source():
        if r == 0:
            got = []
            for _ in range(n - 1):
                t = torch.empty(3, dtype=torch.int64)
                src = dist.recv(t, tag=4)
                got.append((src, int(t[0])))
            return torch.tensor(sorted(got))
        dist.send(torch.full((3,), 10 * r, dtype=torch.int64), 0, tag=4)
        return None

    record("any_source", any_source)

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
