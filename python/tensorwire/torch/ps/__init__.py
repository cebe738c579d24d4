"""Data-parallel training in the parameter-server architecture, over tensorwire slots.

W workers each hold a replica of the model; S servers each own the variables
placed on them round-robin (variable i lives on server i mod S). One synchronous
SGD step:

1. every worker computes the gradients of its batch (forward + backward);
2. it pushes each gradient into a static slot ``grad/<var>/<worker>`` on the
   variable's server (sparse embedding gradients: indices then values into the
   dynamic slot ``sgrad/<var>/<worker>``);
3. a server sums the W gradients of a variable as they arrive, averages them,
   applies its ``torch.optim`` optimizer to its master copy and writes the new
   value straight into every worker's parameter memory: the static slot
   ``param/<var>`` on each worker, whose buffer *is* the parameter's storage;
4. the worker waits until all its parameters arrived, and takes the next step.

Modes (how the sending side holds its tensors):

``zerocopy``  parameters, ``.grad`` tensors and the servers' master copies live
              in registered memory, allocated once at setup; the backward of
              every ``nn.Linear`` writes its gradients straight there
              (:mod:`.alloc_sites`), autograd accumulates into it for other
              parameters, and every push and pull sends the block itself:
              nothing is copied.
``copy``      the same protocol, but the tensors a process sends are ordinary
              torch memory (autograd's fresh gradients, PyTorch's default),
              copied into a registered staging block before each send (the
              paper's "graph analysis turned off").
``gloo``      the same algorithm over ``torch.distributed`` (gloo) send/recv of
              autograd's fresh gradients, the RPC-style baseline.

Devices (``device=``, ps.memory): every role computes on the CPU (default) or
on a GPU (``"cuda"``). On a GPU, ``gdr=True`` (default) keeps parameters,
gradients, slots and master copies in registered GPU memory that moves as is
(the paper's GPUDirect RDMA, §3.5); ``gdr=False`` stages every tensor that
moves through registered host memory (GPU-to-host copy, host transfer,
host-to-GPU copy: Table 2's baseline). The slots' flags stay in host memory.

Use :func:`train` to run everything locally (spawned processes), or
:class:`Server` / :class:`Worker` in processes you start yourself::

    server = ps.Server(rank=0, num_servers=1, num_workers=2, optimizer="sgd", lr=0.1)
    server.run()                                     # until the workers leave

    worker = ps.Worker(model, [server_address], rank=0, num_workers=2)
    for x, y in batches:
        loss = worker.step(lambda: F.cross_entropy(model(x), y))
    worker.close()

The package, one job per file:

``common``     constants, PSError, the variables and their placement, the
               optimizer by name, the bounded waits on peers, Stats;
``server``     Server;
``worker``     Worker;
``gloo``       the gloo baseline (GlooServer, GlooWorker);
``memory``     Memory: where a process computes and where the bytes it
               moves live (CPU, GPU with GDR on or off);
``launch``     train() and the roles it spawns;
``reference``  reference_sgd().

The constants are re-exported here to be read: every module reads its own
import of them, so a test that patches one patches it where it is read
(BYE_GRACE_S in ``server``).
"""

from .common import (
    BYE_GRACE_S,
    DEFAULT_TIMEOUT_S,
    MALLOC_ENV,
    MODES,
    PLACEMENTS,
    STEP_FIELDS,
    PSError,
    Stats,
    VarSpec,
    Wait,
    Watch,
    check_specs,
    make_optimizer,
    place,
    variables,
)
from .gloo import GlooServer, GlooWorker
from .launch import TrainConfig, TrainResult, train
from .memory import NO_GPU, Memory, cuda_problem
from .reference import reference_sgd
from .server import Server
from .worker import Worker

__all__ = [
    "Server",
    "Worker",
    "GlooServer",
    "GlooWorker",
    "train",
    "TrainResult",
    "PSError",
    "VarSpec",
    "variables",
    "place",
    "PLACEMENTS",
    "check_specs",
    "make_optimizer",
    "reference_sgd",
    "MODES",
    "Memory",
    "cuda_problem",
    "NO_GPU",
]
