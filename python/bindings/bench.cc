// Copyright tensorwire authors.
//
// The benchmarks' bindings (the tensorwire_bench library, cpp/src/bench/):
// tensorwire._core.bench_* run the timed loops of tensorwire/bench.h with the
// GIL released; tensorwire._core.UcxBaseline is the raw UCX tag and
// active-message baselines of `tensorwire bench tensor` (tensorwire/bench.h).
// Baseline buffers are given as addresses (numpy: arr.ctypes.data); the
// caller keeps them alive. Every blocking call releases the GIL.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <tuple>

#include "bindings.h"
#include "py_types.h"
#include "tensorwire/bench.h"
#include "tensorwire/error.h"

namespace tensorwire::py {

namespace {
using bench::UcxBaseline;
using nb::gil_scoped_release;

struct PyBaseline {
  std::unique_ptr<UcxBaseline> impl;
  UcxBaseline& get() {
    if (!impl) throw ConnectionError("baseline is closed");
    return *impl;
  }
  ~PyBaseline() {
    gil_scoped_release r;
    impl.reset();
  }
};

void* ptr(std::uintptr_t address) { return reinterpret_cast<void*>(address); }
}  // namespace

void bind_bench(nb::module_& m) {
  // The benchmark kernels (timed loops in C++).
  m.def("bench_write_pingpong", [](Channel& c, nb::handle send, nb::handle recv, const RemoteRegion& remote,
                                   std::size_t size, int iters, int warmup, bool initiator, double timeout) {
    LocalRegion s = local_region_of(send), r = local_region_of(recv);
    gil_scoped_release rel;
    return bench::write_pingpong(c, s, r, remote, size, iters, warmup, initiator, timeout);
  });
  m.def("bench_read_latency",
        [](Channel& c, nb::handle local, const RemoteRegion& remote, std::size_t size, int iters, int warmup) {
          LocalRegion l = local_region_of(local);
          gil_scoped_release rel;
          return bench::read_latency(c, l, remote, size, iters, warmup);
        });
  m.def("bench_stream",
        [](std::vector<Channel> channels, bool is_write, nb::handle local, std::vector<RemoteRegion> remotes,
           std::size_t size, int iters, int window, int warmup, double timeout) {
          LocalRegion l = local_region_of(local);
          bench::StreamResult res;
          {
            gil_scoped_release rel;
            res = bench::stream(channels, is_write, l, remotes, size, iters, window, warmup, timeout);
          }
          return nb::make_tuple(res.seconds, res.completions);
        });
  m.def("bench_wait_flag", [](Channel& c, std::uintptr_t address, std::uint64_t expected, double timeout) {
    gil_scoped_release rel;
    return bench::wait_flag(c, reinterpret_cast<const volatile std::uint64_t*>(address), expected, timeout);
  });
  m.def(
      "bench_stream_for",
      [](std::vector<Channel> channels, bool is_write, nb::handle local, std::vector<RemoteRegion> remotes,
         std::size_t size, int window, double duration, double margin, double bin, double timeout) {
        LocalRegion l = local_region_of(local);
        bench::TimedStream r;
        {
          gil_scoped_release rel;
          r = bench::stream_for(channels, is_write, l, remotes, size, window, duration, margin, bin, timeout);
        }
        nb::dict d;
        d["window_start"] = r.window_start;
        d["window_end"] = r.window_end;
        d["elapsed"] = r.elapsed_s;
        d["bin"] = r.bin_s;
        d["nbins"] = r.nbins;
        d["in_window"] = r.in_window;
        d["total"] = r.total;
        d["bins"] = r.bins;
        return d;
      },
      "Duration-mode stream (perftest -D): per-channel completions inside [margin, duration - margin].");
  m.def(
      "bench_stream_ops",
      [](std::vector<Channel> channels, bool is_write, nb::handle local, std::vector<RemoteRegion> remotes,
         std::size_t size, std::int64_t iters, int window, int warmup, double timeout) {
        LocalRegion l = local_region_of(local);
        bench::TimedOps r;
        {
          gil_scoped_release rel;
          r = bench::stream_ops(channels, is_write, l, remotes, size, iters, window, warmup, timeout);
        }
        return nb::make_tuple(r.seconds, r.posted, r.completions);
      },
      "Iteration-mode stream: (seconds, post times, completion times).");
  m.def(
      "bench_wait_flags",
      [](std::vector<Channel> channels, std::uintptr_t address, std::size_t count, std::uint64_t expected,
         double timeout) {
        gil_scoped_release rel;
        return bench::wait_flags(channels, reinterpret_cast<const volatile std::uint64_t*>(address), count, expected,
                                 timeout);
      },
      "Progresses the channels' workers until every one of `count` words at address is >= expected.");

  nb::class_<PyBaseline>(m, "UcxBaseline",
                         "Raw UCX (tag send/recv and an active-message RPC) on its own ucp context and worker, "
                         "for the baselines of `tensorwire bench tensor`.")
      .def(
          "__init__",
          [](PyBaseline* self, const std::string& transport, unsigned spin_us, bool loopback) {
            new (self) PyBaseline();
            gil_scoped_release r;
            self->impl = std::make_unique<UcxBaseline>(transport, spin_us, loopback);
          },
          nb::arg("transport") = "auto", nb::arg("spin_us") = 100, nb::arg("loopback") = true,
          "transport: auto (UCX_TLS from the environment), tcp, shm or rdma, as Device applies it.")
      .def_prop_ro(
          "address",
          [](PyBaseline& b) {
            std::string a = b.get().address();
            return nb::bytes(a.data(), a.size());
          },
          "This worker's packed address (bytes) for the peer's connect().")
      .def_prop_ro("transports", [](PyBaseline& b) { return b.get().transports(); })
      .def_prop_ro("connected", [](PyBaseline& b) { return b.impl && b.impl->connected(); })
      .def(
          "connect",
          [](PyBaseline& b, nb::bytes address) {
            std::string a(address.c_str(), address.size());
            gil_scoped_release r;
            b.get().connect(a);
          },
          nb::arg("address"), "Creates the endpoint to the peer's worker address.")
      .def(
          "tag_send",
          [](PyBaseline& b, std::uintptr_t buffer, std::size_t nbytes, std::uint64_t tag, double timeout) {
            gil_scoped_release r;
            b.get().tag_send(ptr(buffer), nbytes, tag, timeout);
          },
          nb::arg("buffer"), nb::arg("nbytes"), nb::arg("tag"), nb::arg("timeout") = 60.0,
          "ucp_tag_send_nbx of [buffer, +nbytes); returns when the buffer is reusable.")
      .def(
          "tag_recv",
          [](PyBaseline& b, std::uintptr_t buffer, std::size_t capacity, std::uint64_t tag, double timeout) {
            gil_scoped_release r;
            return b.get().tag_recv(ptr(buffer), capacity, tag, timeout);
          },
          nb::arg("buffer"), nb::arg("capacity"), nb::arg("tag"), nb::arg("timeout") = 60.0,
          "ucp_tag_recv_nbx into [buffer, +capacity) (exact tag); returns the received length.")
      .def(
          "am_request",
          [](PyBaseline& b, nb::bytes header, std::uintptr_t payload, std::size_t nbytes, double timeout) {
            std::string h(header.c_str(), header.size());
            std::string reply;
            {
              gil_scoped_release r;
              reply = b.get().am_request(h, ptr(payload), nbytes, timeout);
            }
            return nb::bytes(reply.data(), reply.size());
          },
          nb::arg("header"), nb::arg("payload"), nb::arg("nbytes"), nb::arg("timeout") = 60.0,
          "RPC over active messages: serializes (copies) the payload into a request, sends it, waits for and "
          "returns the reply.")
      .def(
          "am_recv",
          [](PyBaseline& b, std::uintptr_t buffer, std::size_t capacity, double timeout) {
            UcxBaseline::AmMessage msg;
            {
              gil_scoped_release r;
              msg = b.get().am_recv(ptr(buffer), capacity, timeout);
            }
            return std::make_tuple(nb::bytes(msg.header.data(), msg.header.size()), msg.nbytes);
          },
          nb::arg("buffer"), nb::arg("capacity"), nb::arg("timeout") = 60.0,
          "Server side: waits for one request and copies its payload into [buffer, +capacity); returns "
          "(header, nbytes).")
      .def(
          "am_reply",
          [](PyBaseline& b, nb::bytes payload, double timeout) {
            std::string p(payload.c_str(), payload.size());
            gil_scoped_release r;
            b.get().am_reply(p, timeout);
          },
          nb::arg("payload"), nb::arg("timeout") = 60.0, "Answers the last request with a small reply.")
      .def(
          "close",
          [](PyBaseline& b) {
            gil_scoped_release r;
            b.impl.reset();
          },
          "Closes the endpoint, worker and context (idempotent).");
}

}  // namespace tensorwire::py
