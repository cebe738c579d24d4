"""Rank side of test_torch_dist.py's sparse test: all_reduce of sparse COO tensors on one backend
(argv[1]); each rank saves what it got (indices, values, coalesced flag, or the error's type) to
OUT/rank<r>.pt (argv[2]) for the test to compare with gloo."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import tensorwire.torch  # noqa: F401 - registers "tensorwire"

backend, out_dir = sys.argv[1], sys.argv[2]
dist.init_process_group(backend, timeout=timedelta(seconds=60))
r, n = dist.get_rank(), dist.get_world_size()
results: dict = {}


def record(key: str, fn) -> None:
    try:
        t = fn()
        results[key] = (t._indices().clone(), t._values().clone(), t.is_coalesced(), tuple(t.shape), t.dtype)
    except Exception as e:  # noqa: BLE001 - the test compares error kinds too
        results[key] = f"error: {type(e).__name__}: {e}"


def sparse(shape, nnz, dtype, sparse_dim=None, seed=0, coalesced=True):
    """nnz random entries (repeats allowed: an uncoalesced tensor unless coalesced) of small integers."""
    g = torch.Generator().manual_seed(1000 * seed + r)
    sd = len(shape) if sparse_dim is None else sparse_dim
    idx = (
        torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sd)])
        if sd
        else torch.zeros(0, nnz, dtype=torch.int64)
    )
    vals = torch.randint(-4, 5, (nnz, *shape[sd:]), generator=g).to(dtype)
    t = torch.sparse_coo_tensor(idx, vals, shape)
    return t.coalesce() if coalesced else t


CASES = {
    "vector_f32": lambda: sparse((50,), 3 + 4 * r, torch.float32),
    "matrix_f64": lambda: sparse((6, 7), 5 + r, torch.float64),
    "rows_with_dense_dims": lambda: sparse((20, 3, 2), 4 + 2 * r, torch.float32, sparse_dim=1),  # embedding grads
    "int64_uncoalesced": lambda: sparse((9, 9), 30, torch.int64, coalesced=False, seed=1),
    "empty_on_rank_0": lambda: sparse((8, 5), 0 if r == 0 else 6, torch.float32, seed=2),
    "empty_everywhere": lambda: sparse((4, 4), 0, torch.float32),
    "large": lambda: sparse((100_000, 16), 20_000, torch.float32, sparse_dim=1, seed=3),  # placed messages
}
for name, make in CASES.items():

    def ar(make=make):
        t = make()
        dist.all_reduce(t)
        return t

    record(f"sum/{name}", ar)


def ar_async():  # the Work's future holds the result
    t = sparse((30,), 5, torch.float32, seed=4)
    fut = dist.all_reduce(t, async_op=True).get_future()
    got = fut.wait()[0]
    assert got is t or torch.equal(got.to_dense(), t.to_dense())
    return got


record("async_future", ar_async)


def ar_max():  # gloo sums only: both refuse
    t = sparse((10,), 3, torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


record("max_refused", ar_max)

if backend == "tensorwire":

    def mismatch():  # every rank refuses (each reads every rank's layout), and the group stays usable
        t = sparse((10 + r, 4), 3, torch.float32)
        dist.all_reduce(t)
        return t

    record("shape_mismatch", mismatch)
    after = torch.ones(3)
    dist.all_reduce(after)
    results["after_mismatch"] = after

dist.barrier()
torch.save(results, os.path.join(out_dir, f"rank{r}.pt"))
dist.destroy_process_group()
print(f"rank {r}: {len(results)} results")
