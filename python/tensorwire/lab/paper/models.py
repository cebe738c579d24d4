"""The paper's six benchmark models (Table 1) and a small wide-and-deep model,
written in plain PyTorch.

Table 1 gives, per model, the number of variable tensors and the model size;
its "MB" are MiB (2**20 bytes): with that reading, and 10-class output layers
for the CNNs and the FCN (1000-way for the RNNs), all six sizes below match
Table 1 to the second decimal. The architectures:

* AlexNet: the one-tower AlexNet of TF-slim (``alexnet_v2``): conv 64 11x11/4,
  192 5x5, 384, 384, 256 3x3 with max-pools, fc 4096 (on the 5x5 map), 4096,
  10 classes. 16 variables, 176.42 MiB.
* VGG-16: configuration D (13 conv layers, 3 fc layers), 10 classes.
  32 variables, 512.32 MiB.
* Inception-v3: the Szegedy et al. network with the auxiliary head; every
  convolution is followed by batch normalisation with a learned offset and no
  scale (TF-slim's ``scale=False``), so each convolution holds two variables.
  10 classes. 196 variables, 92.90 MiB.
* LSTM / GRU: hidden size 1024, 80 steps, input 1024, one weight matrix per
  gate and input (W_x, W_h, b per gate), a 1000-way output layer at every step.
  14 and 11 variables, 35.93 and 27.92 MiB.
* FCN-5: five dense layers 784 -> 4096 -> 4096 -> 4096 -> 4096 -> 10.
  10 variables, 204.47 MiB.

Convolutional models end in an adaptive average pool before their dense layers,
so ``image_size`` may be lowered (to make CPU runs affordable) without changing
any variable: the communication per step stays that of the paper's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F


# --------------------------------------------------------------------- CNNs


def _conv_relu(cin: int, cout: int, k: int, stride: int = 1, padding: int | str = "same") -> list[nn.Module]:
    if padding == "same":
        padding = k // 2
    return [nn.Conv2d(cin, cout, k, stride=stride, padding=padding), nn.ReLU(inplace=True)]


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_conv_relu(3, 64, 11, stride=4, padding=0),
            nn.MaxPool2d(3, 2),
            *_conv_relu(64, 192, 5),
            nn.MaxPool2d(3, 2),
            *_conv_relu(192, 384, 3),
            *_conv_relu(384, 384, 3),
            *_conv_relu(384, 256, 3),
            nn.MaxPool2d(3, 2),
            nn.AdaptiveAvgPool2d(5),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(256 * 5 * 5, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    def __init__(self, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in _VGG16:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += _conv_relu(cin, int(v), 3)
                cin = int(v)
        layers.append(nn.AdaptiveAvgPool2d(7))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ConvBN(nn.Module):
    """Convolution without bias, batch norm without scale, a learned offset, ReLU:
    two variables (weight, offset), as TF-slim builds Inception."""

    def __init__(self, cin: int, cout: int, k, stride: int = 1, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3, affine=False)
        self.beta = nn.Parameter(torch.zeros(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)) + self.beta.view(1, -1, 1, 1))


class _Mixed35(nn.Module):  # 35x35 grid: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | pool-1x1
    def __init__(self, cin: int, pool: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, 64, 1)
        self.b5 = nn.Sequential(ConvBN(cin, 48, 1), ConvBN(48, 64, 5, padding=2))
        self.b3 = nn.Sequential(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, padding=1))
        self.bp = ConvBN(cin, pool, 1)

    def forward(self, x):
        p = F.avg_pool2d(x, 3, 1, 1)
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.bp(p)], 1)


class _Reduce35(nn.Module):  # 35 -> 17
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b3 = ConvBN(cin, 384, 3, stride=2)
        self.b33 = nn.Sequential(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, stride=2))

    def forward(self, x):
        return torch.cat([self.b3(x), self.b33(x), F.max_pool2d(x, 3, 2)], 1)


class _Mixed17(nn.Module):  # 17x17 grid with factorised 7x7 convolutions
    def __init__(self, cin: int, mid: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, 192, 1)
        self.b7 = nn.Sequential(
            ConvBN(cin, mid, 1), ConvBN(mid, mid, (1, 7), padding=(0, 3)), ConvBN(mid, 192, (7, 1), padding=(3, 0))
        )
        self.b77 = nn.Sequential(
            ConvBN(cin, mid, 1),
            ConvBN(mid, mid, (7, 1), padding=(3, 0)),
            ConvBN(mid, mid, (1, 7), padding=(0, 3)),
            ConvBN(mid, mid, (7, 1), padding=(3, 0)),
            ConvBN(mid, 192, (1, 7), padding=(0, 3)),
        )
        self.bp = ConvBN(cin, 192, 1)

    def forward(self, x):
        p = F.avg_pool2d(x, 3, 1, 1)
        return torch.cat([self.b1(x), self.b7(x), self.b77(x), self.bp(p)], 1)


class _Reduce17(nn.Module):  # 17 -> 8
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b3 = nn.Sequential(ConvBN(cin, 192, 1), ConvBN(192, 320, 3, stride=2))
        self.b7 = nn.Sequential(
            ConvBN(cin, 192, 1),
            ConvBN(192, 192, (1, 7), padding=(0, 3)),
            ConvBN(192, 192, (7, 1), padding=(3, 0)),
            ConvBN(192, 192, 3, stride=2),
        )

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, 2)], 1)


class _Mixed8(nn.Module):  # 8x8 grid with split 1x3 / 3x1 outputs
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, 320, 1)
        self.b3 = ConvBN(cin, 384, 1)
        self.b3a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.b3b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.bd = nn.Sequential(ConvBN(cin, 448, 1), ConvBN(448, 384, 3, padding=1))
        self.bda = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.bdb = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.bp = ConvBN(cin, 192, 1)

    def forward(self, x):
        a = self.b3(x)
        d = self.bd(x)
        p = F.avg_pool2d(x, 3, 1, 1)
        return torch.cat([self.b1(x), self.b3a(a), self.b3b(a), self.bda(d), self.bdb(d), self.bp(p)], 1)


class InceptionV3(nn.Module):
    def __init__(self, num_classes: int = 1000, aux: bool = True, dropout: float = 0.2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            ConvBN(3, 32, 3, stride=2),
            ConvBN(32, 32, 3),
            ConvBN(32, 64, 3, padding=1),
            nn.MaxPool2d(3, 2),
            ConvBN(64, 80, 1),
            ConvBN(80, 192, 3),
            nn.MaxPool2d(3, 2),
        )
        self.grid35 = nn.Sequential(_Mixed35(192, 32), _Mixed35(256, 64), _Mixed35(288, 64), _Reduce35(288))
        self.grid17 = nn.Sequential(_Mixed17(768, 128), _Mixed17(768, 160), _Mixed17(768, 160), _Mixed17(768, 192))
        self.grid8 = nn.Sequential(_Reduce17(768), _Mixed8(1280), _Mixed8(2048))
        self.aux = None
        if aux:
            self.aux = nn.Sequential(
                nn.AdaptiveAvgPool2d(5),
                ConvBN(768, 128, 1),
                ConvBN(128, 768, 5),
                nn.Flatten(),
                nn.Linear(768, num_classes),
            )
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):
        x = self.grid17(self.grid35(self.stem(x)))
        aux = self.aux(x) if self.aux is not None and self.training else None
        x = torch.flatten(F.adaptive_avg_pool2d(self.grid8(x), 1), 1)
        out = self.fc(self.dropout(x))
        return out if aux is None else out + 0.4 * aux  # one loss over both heads


# --------------------------------------------------------------------- RNNs


class GatedRNN(nn.Module):
    """LSTM or GRU unrolled over the sequence, one (W_x, W_h, b) triple per gate
    as separate variables, and a dense output layer applied at every step."""

    def __init__(self, cell: str = "lstm", input_size: int = 1024, hidden: int = 1024, num_classes: int = 1000) -> None:
        super().__init__()
        if cell not in ("lstm", "gru"):
            raise ValueError(f"cell must be lstm or gru, not {cell!r}")
        self.cell = cell
        self.hidden = hidden
        gates = ("i", "f", "o", "c") if cell == "lstm" else ("z", "r", "h")
        for g in gates:
            self.register_parameter(f"W_{g}", nn.Parameter(torch.empty(input_size, hidden)))
            self.register_parameter(f"U_{g}", nn.Parameter(torch.empty(hidden, hidden)))
            self.register_parameter(f"b_{g}", nn.Parameter(torch.zeros(hidden)))
        self.gates = gates
        bound = hidden**-0.5
        for g in gates:
            nn.init.uniform_(getattr(self, f"W_{g}"), -bound, bound)
            nn.init.uniform_(getattr(self, f"U_{g}"), -bound, bound)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, steps, input) -> (batch*steps, classes)
        b, t, _ = x.shape
        g = self.gates
        # the input projections of all steps at once (one matmul per gate)
        xw = {k: (x.reshape(b * t, -1) @ getattr(self, f"W_{k}") + getattr(self, f"b_{k}")).view(b, t, -1) for k in g}
        u: dict[str, torch.Tensor] = {k: getattr(self, f"U_{k}") for k in g}  # the recurrent weights
        h = x.new_zeros(b, self.hidden)
        c = x.new_zeros(b, self.hidden)
        outs = []
        for s in range(t):
            if self.cell == "lstm":
                i = torch.sigmoid(xw["i"][:, s] + h @ u["i"])
                f = torch.sigmoid(xw["f"][:, s] + h @ u["f"])
                o = torch.sigmoid(xw["o"][:, s] + h @ u["o"])
                c = f * c + i * torch.tanh(xw["c"][:, s] + h @ u["c"])
                h = o * torch.tanh(c)
            else:
                z = torch.sigmoid(xw["z"][:, s] + h @ u["z"])
                r = torch.sigmoid(xw["r"][:, s] + h @ u["r"])
                hh = torch.tanh(xw["h"][:, s] + (r * h) @ u["h"])
                h = (1 - z) * h + z * hh
            outs.append(h)
        return self.out(torch.stack(outs, 1).reshape(b * t, -1))


# --------------------------------------------------------------------- FCN


class FCN5(nn.Module):
    def __init__(self, input_size: int = 784, hidden: int = 4096, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


# --------------------------------------------------------------------- wide & deep


class WideAndDeep(nn.Module):
    """Wide (a sparse linear model over the categorical ids) plus deep (sparse
    embeddings of the ids, concatenated with dense features, through an MLP).
    The embedding tables use ``sparse=True``: their gradients are (indices,
    values) pairs whose length changes with every batch.

    Input: (ids, dense) with ids int64 (batch, fields) in [0, vocab) per field,
    dense float (batch, dense_features). Output: (batch, num_classes) logits."""

    def __init__(
        self,
        fields: int = 4,
        vocab: int = 1000,
        dim: int = 16,
        dense_features: int = 8,
        hidden: int = 64,
        num_classes: int = 2,
    ) -> None:
        super().__init__()
        self.fields, self.vocab = fields, vocab
        self.wide = nn.EmbeddingBag(fields * vocab, num_classes, mode="sum", sparse=True)
        self.wide_bias = nn.Parameter(torch.zeros(num_classes))
        self.embed = nn.Embedding(fields * vocab, dim, sparse=True)
        self.deep = nn.Sequential(
            nn.Linear(fields * dim + dense_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, inputs):
        ids, dense = inputs
        flat = ids + torch.arange(self.fields, device=ids.device) * self.vocab  # one table, field offsets
        wide = self.wide(flat) + self.wide_bias
        deep = self.deep(torch.cat([self.embed(flat).flatten(1), dense], 1))
        return wide + deep


class MLP(nn.Module):
    """A small classifier (the digits convergence run, the tests)."""

    def __init__(self, input_size: int = 64, hidden: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_size, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


# --------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str  # CNN, RNN, FCN, ...
    factory: Callable[[], nn.Module]
    input: str  # "image", "sequence", "vector", "wide_deep"
    classes: int
    paper_mib: float | None  # Table 1: model size ("MB" = MiB)
    paper_vars: int | None  # Table 1: variable tensors
    paper_ms: float | None  # Table 1: computation time (ms, P100 GPU)
    image_size: int = 0  # the paper's input size (images)
    bench_image_size: int = 0  # what `tensorwire train` uses by default on a CPU
    seq_len: int = 0
    input_size: int = 0


def _inception() -> nn.Module:
    return InceptionV3(num_classes=10)


def _lstm() -> nn.Module:
    return GatedRNN("lstm")


def _gru() -> nn.Module:
    return GatedRNN("gru")


MODELS: dict[str, ModelInfo] = {
    "alexnet": ModelInfo("alexnet", "CNN", AlexNet, "image", 10, 176.42, 16, 7.61, 224, 96),
    "inception3": ModelInfo("inception3", "CNN", _inception, "image", 10, 92.90, 196, 68.32, 299, 75),
    "vgg16": ModelInfo("vgg16", "CNN", VGG16, "image", 10, 512.32, 32, 30.92, 224, 32),
    "lstm": ModelInfo("lstm", "RNN", _lstm, "sequence", 1000, 35.93, 14, 33.33, seq_len=80, input_size=1024),
    "gru": ModelInfo("gru", "RNN", _gru, "sequence", 1000, 27.92, 11, 30.44, seq_len=80, input_size=1024),
    "fcn5": ModelInfo("fcn5", "FCN", FCN5, "vector", 10, 204.47, 10, 4.88, input_size=784),
    "widedeep": ModelInfo("widedeep", "sparse", WideAndDeep, "wide_deep", 2, None, None, None),
    "mlp": ModelInfo("mlp", "small", MLP, "vector", 10, None, None, None, input_size=64),
}
PAPER_MODELS = ("alexnet", "inception3", "vgg16", "lstm", "gru", "fcn5")


def get(name: str) -> ModelInfo:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None


def count(model: nn.Module) -> tuple[int, int]:
    """(variable tensors, bytes) of a model's trainable parameters."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return len(ps), sum(p.numel() * p.element_size() for p in ps)


def table(names=PAPER_MODELS + ("widedeep",)) -> list[dict]:
    """Per model: the paper's Table 1 numbers beside ours."""
    rows = []
    for n in names:
        info = get(n)
        with torch.device("meta"):  # no memory, no init cost
            m = info.factory()
        nvars, nbytes = count(m)
        rows.append(
            {
                "model": n,
                "type": info.kind,
                "paper_vars": info.paper_vars,
                "vars": nvars,
                "paper_MiB": info.paper_mib,
                "MiB": round(nbytes / 2**20, 2),
                "params": nbytes // 4,
                "paper_compute_ms": info.paper_ms,
            }
        )
    return rows


def render_table(rows: list[dict]) -> str:
    out = [
        f"{'model':<11} {'type':<6} {'vars (paper)':>13} {'vars (ours)':>12} {'MiB (paper)':>12} "
        f"{'MiB (ours)':>11} {'params':>12}"
    ]
    for r in rows:
        pv = "-" if r["paper_vars"] is None else str(r["paper_vars"])
        pm = "-" if r["paper_MiB"] is None else f"{r['paper_MiB']:.2f}"
        out.append(
            f"{r['model']:<11} {r['type']:<6} {pv:>13} {r['vars']:>12} {pm:>12} {r['MiB']:>11.2f} {r['params']:>12,}"
        )
    return "\n".join(out)
