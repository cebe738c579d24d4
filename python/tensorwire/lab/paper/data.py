"""Training data: synthetic batches generated on the fly (as in the paper's
benchmarks), the scikit-learn digits dataset (the convergence runs), and the
inputs of the models split by tensorwire.torch.partition (ModelInputs, ModelData).

Batches are deterministic functions of (seed, worker rank, step), so a run can
be replayed in one process on the concatenated batches (ps.reference_sgd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import models


def _gen(seed: int, rank: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)
    return g


@dataclass(frozen=True)
class Synthetic:
    """``Synthetic("fcn5", batch=8)(rank, step) -> (inputs, target)`` for any model of models.MODELS."""

    model: str
    batch: int
    seed: int = 0
    image_size: int = 0  # 0: the model's bench_image_size (CNNs)
    seq_len: int = 0  # 0: the model's (RNNs)

    def __call__(self, rank: int, step: int):
        info = models.get(self.model)
        g = _gen(self.seed, rank, step)
        b = self.batch
        if info.input == "image":
            s = self.image_size or info.bench_image_size or info.image_size
            x = torch.randn(b, 3, s, s, generator=g)
            y = torch.randint(0, info.classes, (b,), generator=g)
        elif info.input == "sequence":
            t = self.seq_len or info.seq_len
            x = torch.randn(b, t, info.input_size, generator=g)
            y = torch.randint(0, info.classes, (b * t,), generator=g)
        elif info.input == "vector":
            x = torch.randn(b, info.input_size, generator=g)
            y = torch.randint(0, info.classes, (b,), generator=g)
        elif info.input == "wide_deep":
            return wide_deep_batch(b, rank, step, self.seed)
        else:
            raise ValueError(f"no synthetic data for input kind {info.input!r}")
        return x, y


def wide_deep_batch(
    batch: int, rank: int, step: int, seed: int = 0, fields: int = 4, vocab: int = 1000, dense_features: int = 8
):
    """Categorical ids (skewed: a few ids are frequent) and dense features; the
    label is a fixed function of both, so the model can learn it."""
    g = _gen(seed, rank, step)
    u = torch.rand(batch, fields, generator=g)
    ids = (u.pow(3) * vocab).long().clamp_(max=vocab - 1)  # power law-ish
    dense = torch.randn(batch, dense_features, generator=g)
    y = (((ids % 7).sum(1) + (dense[:, 0] > 0).long() * 3) % 2).long()
    return (ids, dense), y


class Digits:
    """The scikit-learn digits dataset (1797 8x8 images, 10 classes; ships inside
    scikit-learn), scaled to [0, 1]. ``Digits(batch)(rank, step)`` gives worker
    ``rank``'s batch: each epoch is shuffled with the seed and split over the
    workers, so W workers with batch B see what one process sees with W*B."""

    def __init__(self, batch: int, workers: int = 1, seed: int = 0) -> None:
        self.batch, self.workers, self.seed = batch, workers, seed
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None

    def _load(self):
        if self._x is None:
            try:
                from sklearn.datasets import load_digits
            except ImportError as e:
                raise ModuleNotFoundError(
                    "the digits dataset needs scikit-learn: pip install scikit-learn", name="sklearn"
                ) from e
            d = load_digits()
            self._x = torch.tensor(d.data, dtype=torch.float32) / 16.0
            self._y = torch.tensor(d.target, dtype=torch.int64)
        return self._x, self._y

    def __getstate__(self):
        return {"batch": self.batch, "workers": self.workers, "seed": self.seed}

    def __setstate__(self, st):
        type(self).__init__(self, **st)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._load()
        gb = self.batch * self.workers
        per_epoch = len(x) // gb
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(len(x), generator=_gen(self.seed, 0, epoch))
        idx = perm[k * gb : (k + 1) * gb]
        return x[idx], y[idx]

    def __call__(self, rank: int, step: int):
        x, y = self.global_batch(step)
        s = slice(rank * self.batch, (rank + 1) * self.batch)
        return x[s], y[s]

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._load()


# ------------------------------------------------- inputs of a partitioned model


@dataclass(frozen=True)
class ModelInputs:
    """``inputs_fn`` of tensorwire.torch.partition.run for the models of
    tensorwire.lab.paper.models: step -> (x,), synthetic as in training; the
    batch cycles through ``batches`` (more than one size: the edges' shapes
    change from step to step)."""

    model: str
    batches: tuple[int, ...] = (8,)
    seed: int = 0
    image_size: int = 0  # CNNs: 0 is the model's default for CPU runs (as tensorwire train)

    def batch(self, step: int) -> tuple:
        return Synthetic(self.model, self.batches[step % len(self.batches)], self.seed, image_size=self.image_size)(
            0, step
        )

    def __call__(self, step: int) -> tuple:
        x = self.batch(step)[0]
        return x if isinstance(x, tuple) else (x,)


@dataclass(frozen=True)
class ModelData(ModelInputs):
    """``data_fn`` of tensorwire.torch.partition.train: step -> (inputs, target), synthetic."""

    def __call__(self, step: int) -> tuple:
        return self.batch(step)
