// Copyright tensorwire authors.
#include <array>
#include <cstring>

#include <nanobind/stl/array.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "checked.h"
#include "py_types.h"
#include "tensorwire/notify.h"

namespace tensorwire::py {

namespace {

using nb::gil_scoped_release;

Device& dev(PyDevice& d) {
  if (!d.device) throw ConnectionError("device is closed");
  return *d.device;
}

nb::dict peer_dict(const PeerInfo& p) {
  nb::dict d;
  d["device_id"] = p.device_id;
  d["address"] = p.address;
  d["hostname"] = p.hostname;
  d["pid"] = p.pid;
  d["same_host"] = p.same_host;
  d["workers"] = p.workers;
  return d;
}

ProgressMode parse_mode(const std::string& s) {
  if (s == "blocking") return ProgressMode::kBlocking;
  if (s == "polling") return ProgressMode::kPolling;
  if (s == "inline") return ProgressMode::kInline;
  throw InvalidArgument("progress must be 'blocking', 'polling' or 'inline', got '" + s + "'");
}

// Holds a Python callable; drops it under the GIL whatever thread ends it.
struct PyCallable {
  nb::object fn;
  explicit PyCallable(nb::object f) : fn(std::move(f)) {}
  ~PyCallable() {
    if (Py_IsInitialized()) {
      nb::gil_scoped_acquire gil;
      fn.reset();
    } else {
      fn.release();
    }
  }
};

// The offsets and length of a one-sided operation, checked against both
// regions here (not only in the core) so that every op, write_ordered
// included, refuses a bad range at once, with the argument's name.
// How long a notifying write in the message form waits for its data to land.
constexpr double kNotifyAfterS = 60.0;

struct Range {
  std::size_t local_offset, remote_offset, length;
};

Range resolve_range(const LocalRegion& local, nb::handle local_offset, const RemoteRegion& remote,
                    nb::handle remote_offset, nb::handle nbytes, bool reads) {
  const std::uint64_t lo = to_u64(local_offset, "local_offset");
  const std::uint64_t ro = to_u64(remote_offset, "remote_offset");
  const std::uint64_t llen = local.length, rlen = remote.length();
  if (lo > llen) {
    throw InvalidArgument("local_offset " + std::to_string(lo) + " is beyond the end of the local region (" +
                          std::to_string(llen) + " bytes)");
  }
  if (ro > rlen) {
    throw InvalidArgument("remote_offset " + std::to_string(ro) + " is beyond the end of the remote region (" +
                          std::to_string(rlen) + " bytes)");
  }
  // Default: the whole local region from its offset (what a write sends, what
  // a read fills), and the remote range must hold it: a 128 B block written
  // into a 64 B region is refused, not cut to 64 B.
  if (nbytes.is_none()) {
    if (llen - lo > rlen - ro) {
      throw InvalidArgument(std::string(reads ? "read" : "write") + ": the local region holds " +
                            std::to_string(llen - lo) + " bytes from its offset, the remote one only " +
                            std::to_string(rlen - ro) + "; pass nbytes to move part of it");
    }
    return {lo, ro, llen - lo};
  }
  const std::uint64_t n = to_u64(nbytes, "nbytes");
  if (n > llen - lo) {
    throw InvalidArgument("nbytes " + std::to_string(n) + " at local_offset " + std::to_string(lo) +
                          " exceeds the local region of " + std::to_string(llen) + " bytes");
  }
  if (n > rlen - ro) {
    throw InvalidArgument("nbytes " + std::to_string(n) + " at remote_offset " + std::to_string(ro) +
                          " exceeds the remote region of " + std::to_string(rlen) + " bytes");
  }
  return {lo, ro, n};
}

}  // namespace

PyDevice::~PyDevice() {
  // Closing joins threads that may need the GIL (call handlers): release it.
  nb::gil_scoped_release release;
  inbox.reset();  // before the device: it stops serving its call
  device.reset();
}

// The device's notification inbox, held for one call (ConnectionError once closed).
std::shared_ptr<NotifyInbox> inbox_of(PyDevice& d) {
  std::shared_ptr<NotifyInbox> in = d.inbox;
  if (!in || !d.device) throw ConnectionError("device is closed");
  return in;
}

nb::list notification_list(const std::vector<Notification>& got) {
  nb::list out;
  for (auto& n : got) out.append(nb::make_tuple(n.sender, nb::bytes(n.message.data(), n.message.size())));
  return out;
}

// Channel.write / write_ordered / read: the Python signature of a one-sided
// operation (a Block, Registration or registered array; offsets; a length
// that defaults to the whole source, which must fit), checked, then posted without the GIL.
template <Request (Channel::*Op)(const LocalRegion&, std::size_t, const RemoteRegion&, std::size_t, std::size_t),
          bool Reads = false>
auto one_sided() {
  // Offsets and nbytes arrive as Python objects: a size_t parameter would
  // turn -1 or 2**64 into TypeError, and nb::cast a bad_cast.
  return [](Channel& c, nb::handle local, const RemoteRegion& remote, nb::handle local_offset, nb::handle remote_offset,
            nb::handle nbytes) {
    LocalRegion lr = local_region_of(local);
    Range r = resolve_range(lr, local_offset, remote, remote_offset, nbytes, Reads);
    gil_scoped_release release;
    return (c.*Op)(lr, r.local_offset, remote, r.remote_offset, r.length);
  };
}

// Channel.write_batch / read_batch: a list of (local, remote[, local_offset,
// remote_offset, nbytes]) tuples, each resolved like write/read, all checked
// before anything is posted.
template <Request (Channel::*Op)(const std::vector<Transfer>&), bool Reads = false>
auto batch() {
  return [](Channel& c, nb::handle items) {
    std::vector<Transfer> transfers;
    std::size_t i = 0;
    for (nb::handle item : nb::iter(items)) {
      nb::tuple t;
      try {
        t = nb::cast<nb::tuple>(item);
      } catch (const nb::cast_error&) {
        throw InvalidArgument("batch item " + std::to_string(i) +
                              ": expected a tuple (local, remote[, local_offset, remote_offset, nbytes])");
      }
      if (t.size() < 2 || t.size() > 5) {
        throw InvalidArgument("batch item " + std::to_string(i) + ": expected 2 to 5 fields, got " +
                              std::to_string(t.size()));
      }
      Transfer x;
      x.local = local_region_of(t[0]);
      if (!nb::isinstance<RemoteRegion>(t[1])) {
        throw InvalidArgument("batch item " + std::to_string(i) + ": the second field must be a RemoteRegion");
      }
      x.remote = nb::cast<RemoteRegion>(t[1]);
      nb::object zero = nb::int_(0);
      Range r;
      try {
        r = resolve_range(x.local, t.size() > 2 ? t[2] : zero, x.remote, t.size() > 3 ? t[3] : zero,
                          t.size() > 4 ? nb::handle(t[4]) : nb::handle(nb::none()), Reads);
      } catch (const InvalidArgument& e) {
        std::string why = e.what();
        const std::string own = Reads ? "read: " : "write: ";
        if (why.rfind(own, 0) == 0) why = why.substr(own.size());
        throw InvalidArgument(std::string(Reads ? "read_batch" : "write_batch") + " item " + std::to_string(i) + ": " +
                              why);
      }
      x.local_offset = r.local_offset;
      x.remote_offset = r.remote_offset;
      x.length = r.length;
      transfers.push_back(std::move(x));
      ++i;
    }
    gil_scoped_release release;
    return (c.*Op)(transfers);
  };
}

void bind_device(nb::module_& m) {
  nb::class_<Request>(m, "Request", "Completion handle of a data-path operation.")
      .def(
          "wait",
          [](Request& r, nb::handle timeout) {
            double t = to_timeout(timeout, "timeout", /*negative_is_forever=*/true);
            gil_scoped_release release;
            r.wait(t);
          },
          nb::arg("timeout").none() = nb::none(),
          "Waits until complete (timeout in seconds; None = forever). Raises the operation's error, or "
          "Timeout (the operation keeps running).")
      .def("test", &Request::test, "True once complete (progresses the worker once).")
      // done() runs the same completion checks as test() (a dynamic-slot send
      // completes on the receiver's ack, which only a check notices).
      .def(
          "done", [](Request& r) { return r.state() != 0 || r.test(); }, "True once complete; never blocks.")
      .def_prop_ro("failed", [](Request& r) { return r.state() < 0; })
      .def_prop_ro("failed_rank", &Request::failed_rank,
                   "The group rank of the peer whose failure failed it (a Messenger's requests), else -1.")
      .def_prop_ro("error", [](Request& r) { return r.error_message(); })
      .def("__await__", [](nb::handle self) {
        return nb::module_::import_("tensorwire._aio").attr("await_request")(self).attr("__await__")();
      });

  nb::class_<Channel>(m, "Channel", nb::dynamic_attr(), "One endpoint to a peer device on one lane.")
      // The senders' Python side (staging, paths) is tensorwire.slots; these are its entry points.
      .def(
          "static_sender",
          [](nb::handle self, nb::handle name, nb::handle path, nb::handle timeout) {
            return nb::module_::import_("tensorwire.slots").attr("_static_sender")(self, name, path, timeout);
          },
          nb::arg("name").none(), nb::arg("path").none() = "copy", nb::arg("timeout").none() = 10.0,
          nb::sig("def static_sender(self, name: str, path: str = 'copy', timeout: float | None = 10.0) "
                  "-> tensorwire.slots.StaticSender"),
          "A sender for the static slot `name` on this channel's peer (path: 'copy' or 'register', for "
          "tensors that are not a Block).")
      .def(
          "dynamic_sender",
          [](nb::handle self, nb::handle name, nb::handle path, nb::handle timeout) {
            return nb::module_::import_("tensorwire.slots").attr("_dynamic_sender")(self, name, path, timeout);
          },
          nb::arg("name").none(), nb::arg("path").none() = "copy", nb::arg("timeout").none() = 10.0,
          nb::sig("def dynamic_sender(self, name: str, path: str = 'copy', timeout: float | None = 10.0) "
                  "-> tensorwire.slots.DynamicSender"),
          "A sender for the dynamic slot `name` on this channel's peer.")
      .def(
          "write",
          [](nb::handle self, nb::handle local, const RemoteRegion& remote, nb::handle local_offset,
             nb::handle remote_offset, nb::handle nbytes, nb::handle notify) {
            Channel& c = nb::cast<Channel&>(self);
            // The message is checked first: a bad one leaves the data unwritten too.
            std::string message;
            const bool notifying = !notify.is_none();
            if (notifying) {
              if (nb::isinstance<nb::str>(notify)) {
                message = nb::cast<std::string>(notify);
              } else if (nb::isinstance<nb::bytes>(notify)) {
                message.assign(nb::borrow<nb::bytes>(notify).c_str(), nb::len(notify));
              } else {
                throw InvalidArgument("notify must be bytes or str, got " +
                                      std::string(nb::type_name(notify.type()).c_str()));
              }
              if (message.size() > kNotifyMaxMessage) {
                throw InvalidArgument("notify takes at most " + std::to_string(kNotifyMaxMessage) + " bytes, got " +
                                      std::to_string(message.size()));
              }
            }
            NotifySender* sender = nullptr;
            if (notifying) {
              // The channel's notifying side, made on first use and kept with the channel.
              nb::object holder = nb::getattr(self, "_notify_sender", nb::none());
              if (holder.is_none()) {
                NotifySender* made;
                {
                  gil_scoped_release r;
                  made = new NotifySender(c);  // attaches to the target's slot for us: a control call
                }
                holder = nb::cast(made, nb::rv_policy::take_ownership);
                nb::setattr(self, "_notify_sender", holder);
              }
              sender = &nb::cast<NotifySender&>(holder);
              // A full queue at the target refuses the write before its data moves.
              gil_scoped_release r;
              sender->wait_room();
            }
            Request req = one_sided<&Channel::write>()(c, local, remote, local_offset, remote_offset, nbytes);
            if (sender) {
              gil_scoped_release r;
              // The target places message-form data when it arrives: the
              // notification may go only once the data landed (its reply).
              if (c.form() == ChannelForm::kMessages) req.wait(kNotifyAfterS);
              sender->send(message);
            }
            return req;
          },
          nb::arg("local"), nb::arg("remote"), nb::arg("local_offset") = 0, nb::arg("remote_offset") = 0,
          nb::arg("nbytes").none() = nb::none(), nb::arg("notify").none() = nb::none(),
          "One-sided write local[local_offset:+nbytes] -> remote[remote_offset:]. The local bytes may be reused "
          "when the request completes; the data is visible remotely after a later flush(). With notify=bytes "
          "(at most 252), the target's device.notifications() yields (this device's id, notify) once the data is "
          "visible there (tensorwire.notify); PoolExhausted, before anything moves, while the target holds 64 "
          "unread notifications of this device for over 1 s.")
      .def("write_ordered", one_sided<&Channel::write_ordered>(), nb::arg("local"), nb::arg("remote"),
           nb::arg("local_offset") = 0, nb::arg("remote_offset") = 0, nb::arg("nbytes").none() = nb::none(),
           "A write that lands after every write posted earlier on this channel (fence() + write() without "
           "blocking: over tcp it is posted when a flush of the earlier writes completes).")
      .def("write_batch", batch<&Channel::write_batch>(), nb::arg("transfers"),
           "Posts many writes in one call: `transfers` is a list of (local, remote[, local_offset, remote_offset, "
           "nbytes]) tuples, each as in write(). All are checked before any is posted; the one Request completes "
           "when all did (the first error of any).")
      .def("read_batch", batch<&Channel::read_batch, true>(), nb::arg("transfers"),
           "Posts many reads in one call (see write_batch).")
      .def("read", one_sided<&Channel::read, true>(), nb::arg("local"), nb::arg("remote"), nb::arg("local_offset") = 0,
           nb::arg("remote_offset") = 0, nb::arg("nbytes").none() = nb::none(),
           "One-sided read remote -> local; the data is there when it completes.")
      .def(
          "_write_streaming",
          [](Channel& c, nb::handle local, const RemoteRegion& remote, nb::handle local_offset,
             nb::handle remote_offset, nb::handle nbytes) {
            LocalRegion lr = local_region_of(local);
            Range r = resolve_range(lr, local_offset, remote, remote_offset, nbytes, false);
            gil_scoped_release release;
            return c.write_streaming(lr, r.local_offset, remote, r.remote_offset, r.length);
          },
          nb::arg("local"), nb::arg("remote"), nb::arg("local_offset"), nb::arg("remote_offset"), nb::arg("nbytes"),
          "Internal (the torch backend's all_reduce through mapped memory): write() into a peer's mapped region "
          "with streaming stores; complete on return; InvalidArgument when the region is not mapped here.")
      .def(
          "fence",
          [](Channel& c) {
            gil_scoped_release r;
            c.fence();
          },  // may block: other threads run
          "Later operations on this lane's worker land after earlier ones.")
      .def(
          "flush",
          [](Channel& c) {
            gil_scoped_release r;
            return c.flush();
          },
          "A request that completes when every earlier operation is visible at the peer.")
      .def(
          "lookup",
          [](Channel& c, const std::string& name, double timeout) {
            gil_scoped_release r;
            return c.lookup(name, timeout);
          },
          nb::arg("name"), nb::arg("timeout") = 10.0, "The region the peer published under name (NotFound).")
      .def(
          "remote_region",
          [](Channel& c, nb::bytes descriptor) {
            RegionDescriptor d = RegionDescriptor::from_bytes(descriptor.c_str(), descriptor.size());
            gil_scoped_release r;
            return c.remote_region(d);
          },
          nb::arg("descriptor"),
          "The peer's region described by `descriptor` (bytes from block.descriptor() on the peer, sent by any "
          "means). It must lie inside a region the peer exported to this device (publish + lookup, a slot, or "
          "channel.export_region on the peer): InvalidArgument otherwise.")
      .def(
          "export_region",
          [](Channel& c, nb::handle local, double timeout) {
            LocalRegion lr = local_region_of(local);
            std::string d;
            {
              gil_scoped_release r;
              d = c.export_region(lr, timeout).to_bytes();
            }
            return nb::bytes(d.data(), d.size());
          },
          nb::arg("local"), nb::arg("timeout") = 10.0,
          "Lets the peer use descriptors of ranges inside `local` (a Block or Registration) that this side "
          "hands over by other means (one control call). Returns the descriptor exported (bytes): hand over "
          "ranges with its key, which may be a registration of exactly `local`. Where the target checks "
          "accesses (tcp lanes) or keys are exact (RDMA), the export ends when `local`'s memory returns (the "
          "block freed, the registration dropped).")
      .def(
          "call",
          [](Channel& c, const std::string& name, nb::bytes payload, double timeout) {
            std::string p(payload.c_str(), payload.size());
            std::string out;
            {
              gil_scoped_release r;
              out = c.call(name, p, timeout);
            }
            return nb::bytes(out.data(), out.size());
          },
          nb::arg("name"), nb::arg("payload") = nb::bytes("", 0), nb::arg("timeout") = 10.0,
          "Small request/response call to the peer's handler `name`.")
      .def_prop_ro("lane", &Channel::lane)
      .def_prop_ro("peer", [](Channel& c) { return peer_dict(c.peer()); })
      .def("transport_info", &Channel::transport_info, "What UCX chose for this endpoint (lanes, transports).")
      .def(
          "maps",
          [](Channel& c, const RemoteRegion& remote, nb::handle local) {
            LocalRegion lr = local_region_of(local);
            gil_scoped_release release;
            return c.maps(remote, lr);
          },
          nb::arg("remote"), nb::arg("local"),
          "True when write/read between `local` and `remote` are a memcpy in the calling thread (a same-host "
          "peer's region mapped through shared memory); such operations are complete on return.")
      .def(
          "stats",
          [](Channel& c) {
            ChannelStats s = c.stats();
            nb::dict d;
            d["posted"] = s.posted;
            d["direct_writes"] = s.direct_writes;
            d["direct_reads"] = s.direct_reads;
            d["direct_bytes"] = s.direct_bytes;
            d["drains"] = s.drains;
            return d;
          },
          "Counts of this channel's operations by path: posted (to UCX), direct_writes, direct_reads, "
          "direct_bytes, drains (direct copies that first waited for earlier UCX operations after a fence).")
      .def("progress", &Channel::progress)
      .def_prop_ro(
          "form", [](Channel& c) { return std::string(c.form() == ChannelForm::kMessages ? "messages" : "rma"); },
          "How this channel moves data: 'rma' (one-sided) or 'messages' (the target places them; tcp).")
      .def("transports", &Channel::transports,
           "The UCX transports and devices this channel's endpoint uses, 'transport/device' "
           "('posix/memory', 'tcp/lo', 'rc_mlx5/mlx5_0:1'), from UCX's endpoint query.");

  nb::class_<PyDevice>(m, "Device", nb::dynamic_attr(),
                       "A local endpoint of the fabric: UCX context, workers, pool, listener.")
      .def(
          "__init__",
          [](PyDevice* self, const std::string& host, int port, int workers, const std::string& progress,
             unsigned spin_us, const std::string& transport, const std::string& net_devices, const std::string& token,
             std::size_t slab_size, std::size_t pool_limit, double connect_timeout, double keepalive, double liveness,
             int protocol_version, bool map_shared_memory, nb::handle require) {
            if (port < 0 || port > 65535) throw InvalidArgument("port must be in 0..65535");
            DeviceConfig c;
            c.host = host;
            c.port = static_cast<std::uint16_t>(port);
            c.workers = workers;
            c.progress = parse_mode(progress);
            c.spin_us = spin_us;
            c.transport = transport;
            c.net_devices = net_devices;
            if (nb::isinstance<nb::str>(require)) {
              c.require = nb::cast<std::string>(require);
            } else if (!require.is_none()) {  // a list of families
              for (nb::handle f : nb::iter(require))
                c.require += (c.require.empty() ? "" : ",") + nb::cast<std::string>(nb::str(f));
            }
            c.token = token;
            c.slab_size = slab_size;
            c.pool_limit = pool_limit;
            c.connect_timeout_s = connect_timeout;
            c.keepalive_s = keepalive;
            c.liveness_s = liveness;
            c.protocol_version = static_cast<std::uint16_t>(protocol_version);
            c.map_shared_memory = map_shared_memory;
            new (self) PyDevice();
            gil_scoped_release r;
            self->device = std::make_unique<Device>(c);
            // Open to notifications before anyone can know the address.
            self->inbox = std::make_shared<NotifyInbox>(*self->device);
          },
          nb::arg("host") = "127.0.0.1", nb::arg("port") = 0, nb::arg("workers") = 1, nb::arg("progress") = "blocking",
          nb::arg("spin_us") = 100, nb::arg("transport") = "auto", nb::arg("net_devices") = "auto",
          nb::arg("token") = "", nb::arg("slab_size") = std::size_t(64) << 20,
          nb::arg("pool_limit") = std::size_t(16) << 30, nb::arg("connect_timeout") = 10.0, nb::arg("keepalive") = 1.0,
          nb::arg("liveness") = 5.0, nb::arg("protocol_version") = 0, nb::arg("map_shared_memory") = true,
          nb::arg("require").none() = nb::none())
      .def_prop_ro("address", [](PyDevice& d) { return dev(d).address(); })
      .def_prop_ro("id", [](PyDevice& d) { return dev(d).id(); })
      .def_prop_ro("workers", [](PyDevice& d) { return dev(d).config().workers; })
      .def_prop_ro(
          "progress_mode",
          [](PyDevice& d) {
            switch (dev(d).config().progress) {
              case ProgressMode::kBlocking: return std::string("blocking");
              case ProgressMode::kPolling: return std::string("polling");
              case ProgressMode::kInline: break;
            }
            return std::string("inline");
          },
          "The progress mode in effect (TENSORWIRE_PROGRESS overrides the argument).")
      .def_prop_ro(
          "spin_us", [](PyDevice& d) { return dev(d).config().spin_us; },
          "The spin in effect, in microseconds (TENSORWIRE_SPIN_US overrides the argument).")
      .def(
          "alloc_view",
          [](PyDevice& d, nb::handle shape_arg, int code, int bits, const std::string& format, nb::handle alignment_arg,
             int gpu) {
            if (bits <= 0 || bits % 8 != 0) {
              throw InvalidArgument("unsupported element size of " + std::to_string(bits) + " bits");
            }
            const std::size_t itemsize = static_cast<std::size_t>(bits) / 8;
            std::vector<std::int64_t> shape = to_shape(shape_arg);
            // Checked: an unchecked product wrapped (empty((1 << 62,), "float32") leased 64 bytes
            // with the full shape, and DLPack consumers then read far past it).
            const std::size_t nbytes = checked_nbytes(shape, itemsize);
            const std::size_t alignment = to_u64(alignment_arg, "alignment", 4096);
            PyBlock b;
            {
              gil_scoped_release r;
              b.block = gpu < 0 ? dev(d).allocate(nbytes ? nbytes : 1, alignment)
                                : dev(d).allocate(nbytes ? nbytes : 1, alignment, MemoryType::kCuda, gpu);
            }
            b.shape = std::move(shape);
            b.buffer_shape.assign(b.shape.begin(), b.shape.end());
            b.dtype = nb::dlpack::dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
            b.format = format;
            b.itemsize = itemsize;
            b.nbytes = nbytes;
            return b;
          },
          nb::arg("shape"), nb::arg("code"), nb::arg("bits"), nb::arg("format"), nb::arg("alignment") = 64,
          nb::arg("gpu") = -1,
          "Low-level: a pool block with a tensor view, in GPU `gpu`'s memory if >= 0 (use Device.empty).")
      .def(
          "register_memory",
          [](PyDevice& d, nb::handle ptr_arg, nb::handle nbytes_arg, bool gpu) {
            const std::uint64_t ptr = to_u64(ptr_arg, "ptr");
            const std::uint64_t nbytes = to_u64(nbytes_arg, "nbytes", kMaxBytes);
            if (ptr == 0 || nbytes == 0) throw InvalidArgument("cannot register an empty or null range");
            // The core's cache compares ptr + nbytes: keep it from wrapping.
            if (nbytes > std::numeric_limits<std::uintptr_t>::max() - ptr) {
              throw InvalidArgument("ptr + nbytes wraps around the address space");
            }
            gil_scoped_release r;
            return dev(d).pool().register_memory(reinterpret_cast<void*>(ptr), nbytes,
                                                 gpu ? MemoryType::kCuda : MemoryType::kHost);
          },
          nb::arg("ptr"), nb::arg("nbytes"), nb::arg("gpu") = false,
          "Low-level: registers [ptr, ptr+nbytes) (GPU memory if gpu); the caller keeps the memory alive "
          "(use Device.register).")
      .def(
          "publish",
          [](PyDevice& d, const std::string& name, nb::handle region) {
            if (nb::isinstance<PyBlock>(region)) {
              auto& b = nb::cast<PyBlock&>(region);
              if (!b.block) throw InvalidArgument("this block was released");
              RegionDescriptor desc = b.block.descriptor();
              desc.length = b.nbytes ? b.nbytes : desc.length;
              dev(d).publish(name, desc);
            } else if (nb::isinstance<Registration>(region)) {
              dev(d).publish(name, nb::cast<Registration&>(region).descriptor());
            } else {
              throw InvalidArgument("publish needs a Block or a Registration");
            }
          },
          nb::arg("name"), nb::arg("region"), "Makes a block or registration findable by peers under name.")
      .def("unpublish", [](PyDevice& d, const std::string& name) { dev(d).unpublish(name); })
      .def(
          "on_call",
          [](PyDevice& d, const std::string& name, nb::object fn, bool with_caller) {
            if (fn.is_none()) {
              dev(d).on_call(name, nullptr);
              return;
            }
            auto holder = std::make_shared<PyCallable>(std::move(fn));
            if (with_caller) {  // handler(caller device id, bytes): the id the caller claimed in its HELLO (contracts
                                // §11)
              dev(d).on_peer_call(name, [holder](std::uint64_t caller, const std::string& payload) -> std::string {
                nb::gil_scoped_acquire gil;
                try {
                  nb::object out = holder->fn(caller, nb::bytes(payload.data(), payload.size()));
                  if (!nb::isinstance<nb::bytes>(out)) throw std::runtime_error("call handlers must return bytes");
                  nb::bytes b = nb::borrow<nb::bytes>(out);
                  return std::string(b.c_str(), b.size());
                } catch (nb::python_error& e) {
                  throw std::runtime_error(e.what());
                }
              });
              return;
            }
            dev(d).on_call(name, [holder](const std::string& payload) -> std::string {
              nb::gil_scoped_acquire gil;
              try {
                nb::object out = holder->fn(nb::bytes(payload.data(), payload.size()));
                if (!nb::isinstance<nb::bytes>(out)) throw std::runtime_error("call handlers must return bytes");
                nb::bytes b = nb::borrow<nb::bytes>(out);
                return std::string(b.c_str(), b.size());
              } catch (nb::python_error& e) {
                throw std::runtime_error(e.what());
              }
            });
            // Fix: .none() — nanobind rejects None for an nb::object argument by default,
            // so on_call(name, None) (removal, the branch above) raised TypeError.
          },
          nb::arg("name"), nb::arg("handler").none(), nb::arg("with_caller") = false,
          "Registers handler(bytes) -> bytes for channel.call(name, ...); it runs on a dispatcher thread. "
          "with_caller: handler(caller_device_id, bytes), the id the caller claimed in its HELLO on the connection the "
          "call came on: no other live connection holds it unless that device vouched for this one; an id nobody "
          "held is not otherwise proven (docs/contracts.md section 11).")
      .def(
          "connect",
          [](PyDevice& d, const std::string& address, int lane) {
            Device& device = dev(d);
            gil_scoped_release r;
            return device.connect(address, lane);
          },
          nb::arg("address"), nb::arg("lane") = 0, "A channel to the device at host:port on lane.")
      .def(
          "channel_to",
          [](PyDevice& d, std::uint64_t peer_id, int lane) {
            Device& device = dev(d);
            gil_scoped_release r;
            return device.channel_to(peer_id, lane);
          },
          nb::arg("peer_id"), nb::arg("lane") = 0, "A channel back to a peer that connected to us.")
      .def("peers",
           [](PyDevice& d) {
             nb::list out;
             for (auto& p : dev(d).peers()) out.append(peer_dict(p));
             return out;
           })
      .def(
          "wait_for_peer",
          [](PyDevice& d, double timeout) {
            Device& device = dev(d);
            PeerInfo p;
            {
              gil_scoped_release r;
              p = device.wait_for_peer(timeout);
            }
            return peer_dict(p);
          },
          nb::arg("timeout") = 10.0, "Blocks until a new peer connected; returns its description.")
      .def("progress", [](PyDevice& d) { return dev(d).progress(); })
      .def("stats",
           [](PyDevice& d) {
             PoolStats s = dev(d).pool().stats();
             nb::dict out;
             out["bytes_in_use"] = s.bytes_in_use;
             out["bytes_reserved"] = s.bytes_reserved;
             out["slabs"] = s.slabs;
             out["blocks"] = s.blocks;
             out["registrations"] = s.registrations;
             out["registration_cache_hits"] = s.registration_cache_hits;
             out["registration_cache_misses"] = s.registration_cache_misses;
             out["exact_exports"] = s.exact_exports;
             out["refusals"] = dev(d).refusals();
             return out;
           })
      .def("describe", [](PyDevice& d) { return dev(d).describe(); })
      .def(
          "resources", [](PyDevice& d) { return dev(d).resources(); },
          "UCX's data resources on this device, 'transport/device'.")
      .def_prop_ro("closed", [](PyDevice& d) { return !d.device || d.device->closed(); })
      .def(
          "close",
          [](PyDevice& d) {
            if (!d.device) return;
            std::shared_ptr<NotifyInbox> in = std::move(d.inbox);
            gil_scoped_release r;
            in.reset();  // before the device: it stops serving its call
            d.device->close();
          },
          "Fails pending work, closes connections, stops threads. Blocks stay readable.")
      .def(
          "take_notifications",
          [](PyDevice& d) {
            std::shared_ptr<NotifyInbox> in = inbox_of(d);
            std::vector<Notification> got;
            {
              gil_scoped_release r;
              got = in->take();
            }
            return notification_list(got);
          },
          "Every notification that arrived: [(sender device id, bytes)], in order per sender; never blocks "
          "(use device.notifications()).")
      .def(
          "wait_notifications",
          [](PyDevice& d, nb::handle timeout) {
            const double t = to_timeout(timeout, "timeout", /*negative_is_forever=*/true);
            std::shared_ptr<NotifyInbox> in = inbox_of(d);
            std::vector<Notification> got;
            {
              gil_scoped_release r;
              got = in->wait(t);
            }
            return notification_list(got);
          },
          nb::arg("timeout").none() = nb::none(),
          "At least one notification (Timeout after `timeout` s; use device.next_notification()).");

  m.def("transport_family", &transport_family, nb::arg("ucx_transport"),
        "The family of a UCX transport name: tcp, shm, rdma, cuda, self, or '' (the core's one table).");
  m.def("unusable_reason", &unusable_reason, nb::arg("resources"), nb::arg("family"),
        "Why transport family `family` is not usable with UCX `resources` ('transport/device'), '' if it is.");
}

}  // namespace tensorwire::py
