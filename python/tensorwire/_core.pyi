"""
tensorwire core: devices, registered memory, channels and one-sided transfers over UCX
"""

from collections.abc import Coroutine, Sequence
from typing import Any

import numpy.typing
from numpy.typing import NDArray

import tensorwire.slots


class Block:
    """
    Registered pool memory. numpy/torch view it zero-copy (DLPack, buffer protocol).
    """

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor view."""

    @property
    def capacity(self) -> int:
        """Bytes leased from the pool."""

    @property
    def ptr(self) -> int: ...

    @property
    def shape(self) -> list[int]: ...

    @property
    def format(self) -> str: ...

    @property
    def released(self) -> bool: ...

    @property
    def memory(self) -> str:
        """Where the bytes live: 'host' or 'cuda:<gpu>'."""

    def descriptor(self) -> bytes:
        """The region descriptor a peer needs to reach this block (bytes)."""

    def numpy(self) -> NDArray:
        """A numpy array viewing this block (zero copy; keeps the block alive)."""

    def __dlpack__(self, **kwargs) -> object: ...

    def __dlpack_device__(self) -> tuple: ...

    def release(self) -> None:
        """
        Returns the memory to the pool now. Views taken earlier must not be used afterwards.
        """

    def __len__(self) -> int: ...

    def __repr__(self) -> str: ...

    def __buffer__(self, flags: int, /) -> memoryview: ...

class Registration:
    """Outside memory registered with a device."""

    @property
    def nbytes(self) -> int: ...

    @property
    def ptr(self) -> int: ...

    @property
    def memory(self) -> str:
        """Where the bytes live: 'host' or 'cuda:<gpu>'."""

    def descriptor(self) -> bytes: ...

class RemoteRegion:
    """A peer's region, as returned by channel.lookup()."""

    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def device_id(self) -> int: ...

    @property
    def memory(self) -> str:
        """
        Where the peer's bytes live: 'host' or 'cuda' (the peer's GPU ordinal is not sent).
        """

    def descriptor(self) -> bytes: ...

    def __repr__(self) -> str: ...

def cuda_info() -> dict:
    """
    What the CUDA driver offers: available, reason (when not), driver_version, devices (names).
    """

def parse_descriptor(arg: bytes, /) -> dict:
    """Decodes a region descriptor (raises on malformed input)."""

class Request:
    """Completion handle of a data-path operation."""

    def wait(self, timeout: object | None = None) -> None:
        """
        Waits until complete (timeout in seconds; None = forever). Raises the operation's error, or Timeout (the operation keeps running).
        """

    def test(self) -> bool:
        """True once complete (progresses the worker once)."""

    def done(self) -> bool:
        """True once complete; never blocks."""

    @property
    def failed(self) -> bool: ...

    @property
    def failed_rank(self) -> int:
        """
        The group rank of the peer whose failure failed it (a Messenger's requests), else -1.
        """

    @property
    def error(self) -> str: ...

    def __await__(self) -> object: ...

class Channel:
    """One endpoint to a peer device on one lane."""

    def static_sender(self, name: str, path: str = 'copy', timeout: float | None = 10.0) -> tensorwire.slots.StaticSender:
        """
        A sender for the static slot `name` on this channel's peer (path: 'copy' or 'register', for tensors that are not a Block).
        """

    def dynamic_sender(self, name: str, path: str = 'copy', timeout: float | None = 10.0) -> tensorwire.slots.DynamicSender:
        """A sender for the dynamic slot `name` on this channel's peer."""

    def write(self, local: object, remote: RemoteRegion, local_offset: object = 0, remote_offset: object = 0, nbytes: object | None = None, notify: object | None = None) -> Request:
        """
        One-sided write local[local_offset:+nbytes] -> remote[remote_offset:]. The local bytes may be reused when the request completes; the data is visible remotely after a later flush(). With notify=bytes (at most 252), the target's device.notifications() yields (this device's id, notify) once the data is visible there (tensorwire.notify); PoolExhausted, before anything moves, while the target holds 64 unread notifications of this device for over 1 s.
        """

    def write_ordered(self, local: object, remote: RemoteRegion, local_offset: object = 0, remote_offset: object = 0, nbytes: object | None = None) -> Request:
        """
        A write that lands after every write posted earlier on this channel (fence() + write() without blocking: over tcp it is posted when a flush of the earlier writes completes).
        """

    def write_batch(self, transfers: object) -> Request:
        """
        Posts many writes in one call: `transfers` is a list of (local, remote[, local_offset, remote_offset, nbytes]) tuples, each as in write(). All are checked before any is posted; the one Request completes when all did (the first error of any).
        """

    def read_batch(self, transfers: object) -> Request:
        """Posts many reads in one call (see write_batch)."""

    def read(self, local: object, remote: RemoteRegion, local_offset: object = 0, remote_offset: object = 0, nbytes: object | None = None) -> Request:
        """One-sided read remote -> local; the data is there when it completes."""

    def fence(self) -> None:
        """Later operations on this lane's worker land after earlier ones."""

    def flush(self) -> Request:
        """
        A request that completes when every earlier operation is visible at the peer.
        """

    def lookup(self, name: str, timeout: float = 10.0) -> RemoteRegion:
        """The region the peer published under name (NotFound)."""

    def remote_region(self, descriptor: bytes) -> RemoteRegion:
        """
        The peer's region described by `descriptor` (bytes from block.descriptor() on the peer, sent by any means). It must lie inside a region the peer exported to this device (publish + lookup, a slot, or channel.export_region on the peer): InvalidArgument otherwise.
        """

    def export_region(self, local: object, timeout: float = 10.0) -> bytes:
        """
        Lets the peer use descriptors of ranges inside `local` (a Block or Registration) that this side hands over by other means (one control call). Returns the descriptor exported (bytes): hand over ranges with its key, which may be a registration of exactly `local`. Where the target checks accesses (tcp lanes) or keys are exact (RDMA), the export ends when `local`'s memory returns (the block freed, the registration dropped).
        """

    def call(self, name: str, payload: bytes = ..., timeout: float = 10.0) -> bytes:
        """Small request/response call to the peer's handler `name`."""

    @property
    def lane(self) -> int: ...

    @property
    def peer(self) -> dict: ...

    def transport_info(self) -> str:
        """What UCX chose for this endpoint (lanes, transports)."""

    def maps(self, remote: RemoteRegion, local: object) -> bool:
        """
        True when write/read between `local` and `remote` are a memcpy in the calling thread (a same-host peer's region mapped through shared memory); such operations are complete on return.
        """

    def stats(self) -> dict:
        """
        Counts of this channel's operations by path: posted (to UCX), direct_writes, direct_reads, direct_bytes, drains (direct copies that first waited for earlier UCX operations after a fence).
        """

    def progress(self) -> int: ...

    @property
    def form(self) -> str:
        """
        How this channel moves data: 'rma' (one-sided) or 'messages' (the target places them; tcp).
        """

    def transports(self) -> list[str]:
        """
        The UCX transports and devices this channel's endpoint uses, 'transport/device' ('posix/memory', 'tcp/lo', 'rc_mlx5/mlx5_0:1'), from UCX's endpoint query.
        """

class Device:
    """A local endpoint of the fabric: UCX context, workers, pool, listener."""

    def __init__(self, host: str = '127.0.0.1', port: int = 0, workers: int = 1, progress: str = 'blocking', spin_us: int = 100, transport: str = 'auto', net_devices: str = 'auto', token: str = '', slab_size: int = 67108864, pool_limit: int = 17179869184, connect_timeout: float = 10.0, keepalive: float = 1.0, liveness: float = 5.0, protocol_version: int = 0, map_shared_memory: bool = True, require: object | None = None) -> None: ...

    @property
    def address(self) -> str: ...

    @property
    def id(self) -> int: ...

    @property
    def workers(self) -> int: ...

    @property
    def progress_mode(self) -> str:
        """
        The progress mode in effect (TENSORWIRE_PROGRESS overrides the argument).
        """

    @property
    def spin_us(self) -> int:
        """
        The spin in effect, in microseconds (TENSORWIRE_SPIN_US overrides the argument).
        """

    def alloc_view(self, shape: object, code: int, bits: int, format: str, alignment: object = 64, gpu: int = -1) -> Block:
        """
        Low-level: a pool block with a tensor view, in GPU `gpu`'s memory if >= 0 (use Device.empty).
        """

    def register_memory(self, ptr: object, nbytes: object, gpu: bool = False) -> Registration:
        """
        Low-level: registers [ptr, ptr+nbytes) (GPU memory if gpu); the caller keeps the memory alive (use Device.register).
        """

    def publish(self, name: str, region: object) -> None:
        """Makes a block or registration findable by peers under name."""

    def unpublish(self, arg: str, /) -> None: ...

    def on_call(self, name: str, handler: object | None, with_caller: bool = False) -> None:
        """
        Registers handler(bytes) -> bytes for channel.call(name, ...); it runs on a dispatcher thread. with_caller: handler(caller_device_id, bytes), the id the caller claimed in its HELLO on the connection the call came on: no other live connection holds it unless that device vouched for this one; an id nobody held is not otherwise proven (docs/contracts.md section 11).
        """

    def connect(self, address: str, lane: int = 0) -> Channel:
        """A channel to the device at host:port on lane."""

    def channel_to(self, peer_id: int, lane: int = 0) -> Channel:
        """A channel back to a peer that connected to us."""

    def peers(self) -> list: ...

    def wait_for_peer(self, timeout: float = 10.0) -> dict:
        """Blocks until a new peer connected; returns its description."""

    def progress(self) -> int: ...

    def stats(self) -> dict: ...

    def describe(self) -> str: ...

    def resources(self) -> list[str]:
        """UCX's data resources on this device, 'transport/device'."""

    @property
    def closed(self) -> bool: ...

    def close(self) -> None:
        """
        Fails pending work, closes connections, stops threads. Blocks stay readable.
        """

    def take_notifications(self) -> list:
        """
        Every notification that arrived: [(sender device id, bytes)], in order per sender; never blocks (use device.notifications()).
        """

    def wait_notifications(self, timeout: object | None = None) -> list:
        """
        At least one notification (Timeout after `timeout` s; use device.next_notification()).
        """

def transport_family(ucx_transport: str) -> str:
    """
    The family of a UCX transport name: tcp, shm, rdma, cuda, self, or '' (the core's one table).
    """

def unusable_reason(resources: Sequence[str], family: str) -> str:
    """
    Why transport family `family` is not usable with UCX `resources` ('transport/device'), '' if it is.
    """

def bench_write_pingpong(arg0: Channel, arg1: object, arg2: object, arg3: RemoteRegion, arg4: int, arg5: int, arg6: int, arg7: bool, arg8: float, /) -> list[float]: ...

def bench_read_latency(arg0: Channel, arg1: object, arg2: RemoteRegion, arg3: int, arg4: int, arg5: int, /) -> list[float]: ...

def bench_stream(arg0: Sequence[Channel], arg1: bool, arg2: object, arg3: Sequence[RemoteRegion], arg4: int, arg5: int, arg6: int, arg7: int, arg8: float, /) -> tuple: ...

def bench_wait_flag(arg0: Channel, arg1: int, arg2: int, arg3: float, /) -> bool: ...

def bench_stream_for(arg0: Sequence[Channel], arg1: bool, arg2: object, arg3: Sequence[RemoteRegion], arg4: int, arg5: int, arg6: float, arg7: float, arg8: float, arg9: float, /) -> dict:
    """
    Duration-mode stream (perftest -D): per-channel completions inside [margin, duration - margin].
    """

def bench_stream_ops(arg0: Sequence[Channel], arg1: bool, arg2: object, arg3: Sequence[RemoteRegion], arg4: int, arg5: int, arg6: int, arg7: int, arg8: float, /) -> tuple:
    """Iteration-mode stream: (seconds, post times, completion times)."""

def bench_wait_flags(arg0: Sequence[Channel], arg1: int, arg2: int, arg3: int, arg4: float, /) -> bool:
    """
    Progresses the channels' workers until every one of `count` words at address is >= expected.
    """

class UcxBaseline:
    """
    Raw UCX (tag send/recv and an active-message RPC) on its own ucp context and worker, for the baselines of `tensorwire bench tensor`.
    """

    def __init__(self, transport: str = 'auto', spin_us: int = 100, loopback: bool = True) -> None:
        """
        transport: auto (UCX_TLS from the environment), tcp, shm or rdma, as Device applies it.
        """

    @property
    def address(self) -> bytes:
        """This worker's packed address (bytes) for the peer's connect()."""

    @property
    def transports(self) -> str: ...

    @property
    def connected(self) -> bool: ...

    def connect(self, address: bytes) -> None:
        """Creates the endpoint to the peer's worker address."""

    def tag_send(self, buffer: int, nbytes: int, tag: int, timeout: float = 60.0) -> None:
        """
        ucp_tag_send_nbx of [buffer, +nbytes); returns when the buffer is reusable.
        """

    def tag_recv(self, buffer: int, capacity: int, tag: int, timeout: float = 60.0) -> int:
        """
        ucp_tag_recv_nbx into [buffer, +capacity) (exact tag); returns the received length.
        """

    def am_request(self, header: bytes, payload: int, nbytes: int, timeout: float = 60.0) -> bytes:
        """
        RPC over active messages: serializes (copies) the payload into a request, sends it, waits for and returns the reply.
        """

    def am_recv(self, buffer: int, capacity: int, timeout: float = 60.0) -> tuple[bytes, int]:
        """
        Server side: waits for one request and copies its payload into [buffer, +capacity); returns (header, nbytes).
        """

    def am_reply(self, payload: bytes, timeout: float = 60.0) -> None:
        """Answers the last request with a small reply."""

    def close(self) -> None:
        """Closes the endpoint, worker and context (idempotent)."""

class StaticSlot:
    """
    Receiver side of static placement: depth pre-allocated buffers of one shape and dtype.
    """

    def __init__(self, device: Device, name: str, shape: object, code: int, bits: int, depth: object = 2, first_seq: object = 1, gpu: int = -1) -> None: ...

    def recv(self, timeout: float | None = None) -> numpy.typing.NDArray[Any]:
        """
        Waits for the next tensor; returns a zero-copy view of it (valid until release()): a numpy array (the same array each time its buffer comes round), or for a slot in GPU memory a DLPack array on the GPU (torch.from_dlpack(view)).
        """

    def recv_async(self, timeout: float | None = None) -> Coroutine[Any, Any, numpy.typing.NDArray[Any]]:
        """
        Awaits the next tensor without blocking the event loop (a cancelled await loses no tensor).
        """

    def poll(self) -> numpy.typing.NDArray[Any] | None:
        """
        Non-blocking recv(): the next tensor's view, or None if it has not arrived.
        """

    def release(self, view: object | None = None) -> None:
        """
        Marks the oldest received tensor consumed (its view must not be used afterwards) and tells the sender.
        """

    @property
    def shape(self) -> list[int]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def depth(self) -> int: ...

    @property
    def memory(self) -> str:
        """
        Where the buffers live: 'host' or 'cuda:<gpu>' (the sequence words are always host memory).
        """

    @property
    def next_seq(self) -> int: ...

    @property
    def has_sender(self) -> bool: ...

    def stats(self) -> dict: ...

class StaticSender:
    """Sender side of a static slot (use channel.static_sender)."""

    def __init__(self, channel: Channel, name: str, timeout: object | None = 10.0) -> None: ...

    def send_block(self, block: Block, timeout: object | None = 10.0) -> Request:
        """Sends a pool block (zero copy)."""

    def send_outside(self, address: int, gpu: int, shape: object, code: int, bits: int, path: str, timeout: object | None, owner: object | None) -> Request:
        """
        Sends the contiguous tensor at `address` (host memory when gpu < 0, else that GPU's), of `shape` and DLPack dtype (code, bits), by `path`: 'copy' into the sender's staging block, or 'register' in place (held registered, and `owner` alive, until the send completes).
        """

    def wait_consumed(self, seq: object, timeout: object | None = 10.0) -> None:
        """Blocks until the receiver released tensor `seq`."""

    @property
    def consumed(self) -> int: ...

    @property
    def region(self) -> RemoteRegion:
        """
        The slot's memory at the receiver, as its attach reply exported it to this sender.
        """

    @property
    def sent(self) -> int: ...

    @property
    def shape(self) -> list[int]: ...

    @property
    def dtype(self) -> str: ...

    def stats(self) -> dict: ...

class DynamicSlot:
    """Receiver side of dynamic allocation: tensors of any shape."""

    def __init__(self, device: Device, name: str, max_ndim: object = 8, max_nbytes: object = 4294967296, gpu: int = -1) -> None: ...

    def recv(self, timeout: object | None = None) -> Block:
        """
        Waits for the next tensor; returns a Block (registered memory) holding it, with its shape and dtype.
        """

    def recv_async(self, timeout: float | None = None) -> Coroutine[Any, Any, Block]:
        """
        Awaits the next tensor without blocking the event loop (a cancelled await loses no tensor).
        """

    def poll(self) -> object: ...

    @property
    def record_size(self) -> int: ...

    @property
    def next_seq(self) -> int: ...

    def stats(self) -> dict: ...

class DynamicSender:
    """Sender side of a dynamic slot (use channel.dynamic_sender)."""

    def __init__(self, channel: Channel, name: str, timeout: object | None = 10.0) -> None: ...

    def send_block(self, block: Block, timeout: object | None = 10.0) -> Request: ...

    def send_outside(self, address: int, gpu: int, shape: object, code: int, bits: int, path: str, timeout: object | None, owner: object | None) -> Request:
        """
        Sends the contiguous tensor at `address` (host memory when gpu < 0, else that GPU's), of `shape` and DLPack dtype (code, bits), by `path`: 'copy' into the sender's staging block, or 'register' in place (held registered, and `owner` alive, until the send completes).
        """

    @property
    def region(self) -> RemoteRegion:
        """
        The slot's record at the receiver, as its attach reply exported it to this sender.
        """

    def stats(self) -> dict: ...

class Word:
    """
    A flag a peer writes one-sidedly, for wait_any: ready once the 8-byte word at `offset` of `local` (a Block or Registration) equals `value`. With `channel` (the one the peer writes over), the wait drives its worker where the writes need it (tcp) and fails with its peer.
    """

    def __init__(self, local: object, offset: object, value: object, channel: Channel | None = None) -> None: ...

    @property
    def offset(self) -> int: ...

    @property
    def value(self) -> int: ...

class NotifySender:
    """The notifying side of a channel (channel.write(..., notify=))."""

    def __init__(self, channel: Channel, timeout: object | None = 10.0) -> None: ...

    def send(self, message: bytes, timeout: object | None = 10.0) -> None: ...

def dtypes() -> list[tuple[str, int, int, str]]:
    """
    The supported dtypes: (name, DLPack type code, bits, buffer-protocol format), the core's one table.
    """

def wait_any(items: object, timeout: object | None = None) -> int:
    """
    Waits until one of `items` (static slots, dynamic slots, requests, words) is ready; returns its index.

    A slot is ready once its next tensor arrived (recv() returns at once), a request once it completed (wait() returns or raises at once), a Word once it holds its value. A channel in `items` is never ready: it is watched, and its peer's failure fails the wait. Raises PeerFailed (or ConnectionError) when the sender of a slot, or a watched channel's peer, fails; Timeout after `timeout` seconds (None: no bound). The GIL is released meanwhile.
    """

class Receive:
    """A posted receive: its request, and the sender's rank once complete."""

    @property
    def request(self) -> Request: ...

    @property
    def source(self) -> int:
        """The sender's rank once the request completed (-1 before)."""

class Messenger:
    """
    Tagged messages between the ranks of a group (the C++ engine, tensorwire/messenger.h).
    """

    def __init__(self, device: Device, rank: int, size: int, store_set: object, store_get: object, name: str = 'msg', timeout: float = 300.0, eager_bytes: int = 131072, progress_thread: bool = True) -> None:
        """
        Connects to every rank of the group, meeting them through store_set(key, value) and store_get(key, timeout) -> bytes (e.g. a torch.distributed store's set and get).
        """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def isend(self, ptr: int, nbytes: int, peer: int, tag: int = 0, keep: object | None = None, base: int = 0, base_bytes: int = 0) -> Request:
        """
        Posts a send of the nbytes at address ptr (held alive by `keep`, inside the allocation [base, base + base_bytes) if given) to rank `peer`; the bytes may change once the Request completes.
        """

    def irecv(self, ptr: int, nbytes: int, peer: int, tag: int = 0, keep: object | None = None, base: int = 0, base_bytes: int = 0) -> Receive:
        """
        Posts a receive into the nbytes at ptr from rank `peer` (-1: any rank); returns a Receive.
        """

    @property
    def timeout(self) -> float: ...

    def stats(self) -> dict: ...

    def close(self) -> None:
        """Fails what is pending (ConnectionError) and stops. Idempotent."""

ANY_SOURCE: int = -1

class Collectives:
    """
    Collective operations on a Messenger (the C++ layer, tensorwire/collectives.h): blocking calls every rank makes in the same order with matching sizes.
    """

    def __init__(self, messenger: Messenger) -> None:
        """
        The collectives of the messenger's group. One per Messenger: two would take each other's messages.
        """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def calls(self) -> int:
        """Calls made so far."""

    @property
    def small_allreduce_limit(self) -> int:
        """
        allreduce up to this many bytes takes recursive doubling, larger the ring (64 KiB, or TENSORWIRE_COLL_SMALL_BYTES when this object was made).
        """

    def allreduce_algorithm(self, count: int, dtype: str) -> str:
        """
        What allreduce's 'auto' takes for count elements: 'doubling' or 'ring'.
        """

    def allreduce(self, ptr: int, count: int, dtype: str, op: str = 'sum', keep: object | None = None, base: int = 0, base_bytes: int = 0, timeout: float = -1.0, algorithm: str = 'auto', factor: float = 1.0) -> None:
        """
        In place: the count elements of `dtype` at ptr become op over every rank's (op: sum, product, min, max, band, bor, bxor, avg, premul_sum; what a dtype supports: docs/collectives.md). algorithm: 'auto' (by size), 'doubling' or 'ring', the same on every rank. timeout < 0: the messenger's.
        """

    def alltoall(self, in_ptr: int, out_ptr: int, block_bytes: int, in_keep: object | None = None, out_keep: object | None = None, timeout: float = -1.0) -> None:
        """
        Block r (block_bytes at in_ptr + r * block_bytes) goes to rank r; block s of out comes from rank s. in and out must not overlap.
        """

    def broadcast(self, ptr: int, nbytes: int, root: int, keep: object | None = None, base: int = 0, base_bytes: int = 0, timeout: float = -1.0) -> None:
        """In place: root's nbytes at ptr on every rank."""

    def barrier(self, timeout: float = -1.0) -> None:
        """Returns once every rank has entered it (a dissemination barrier)."""

def ucx_version() -> str:
    """Version of the UCX library loaded at run time."""

def ucx_library_path() -> str:
    """File the UCX library was loaded from."""

def ucx_header_version() -> str:
    """UCX API version tensorwire was compiled against."""

def ucx_limits() -> list[str]:
    """
    What the UCX tensorwire was compiled against cannot do that a newer UCX can (empty from 1.14 on).
    """

def copy(dst: int, src: int, nbytes: int) -> None:
    """
    Copies nbytes from address src to address dst, without the GIL, as the direct path copies (`rep movsb` from 64 KiB, streaming stores for the largest copies). The ranges must not overlap.
    """

def protocol_version() -> int:
    """tensorwire control-protocol version."""

ucx_source: str = 'wheel'
