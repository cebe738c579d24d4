// Copyright tensorwire authors.
//
// Writes the seed inputs of the fuzz targets: valid encodings made by the
// real encoders, so the seeds follow any change of a wire format. Run by
// `make fuzz-seeds` into tests/fuzz/corpus/<target>/seed-*; the rest of each
// committed corpus is what libFuzzer found and `-merge=1` kept.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/bytes.h"
#include "core/control_wire.h"
#include "core/messages.h"
#include "net/socket.h"
#include "protocol/dynamic_record.h"
#include "tensorwire/region.h"

namespace ctl = tensorwire::control;
namespace td = tensorwire::detail;
using tensorwire::DType;
using tensorwire::MemoryType;
using tensorwire::RegionDescriptor;

namespace {

std::string out_dir;

void write(const std::string& target, const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(out_dir + "/" + target);
  const std::string path = out_dir + "/" + target + "/seed-" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

RegionDescriptor descriptor(MemoryType mt, std::uint64_t address, std::uint64_t length, std::string rkey) {
  RegionDescriptor d;
  d.device_id = 0x1122334455667788ULL;
  d.address = address;
  d.length = length;
  d.memory_type = mt;
  d.rkey = std::move(rkey);
  return d;
}

ctl::Hello hello(std::size_t workers, std::string token) {
  ctl::Hello h;
  h.device_id = 7;
  h.pid = 4242;
  h.start_time = 987654;
  h.boot_id = "7d0b9c3e-0000-4000-8000-000000000000";
  h.hostname = "node-a";
  h.address = "10.0.0.1:13337";
  h.token = std::move(token);
  for (std::size_t i = 0; i < workers; ++i) h.workers.push_back("worker-address-" + std::to_string(i));
  return h;
}

std::string message(ctl::MsgType type, std::string_view body, ctl::Status status = ctl::Status::kOk,
                    std::uint16_t version = ctl::kProtocolVersion) {
  ctl::Header h;
  h.version = version;
  h.type = type;
  h.request_id = 3;
  h.status = status;
  return ctl::encode(h, body);
}

// The fuzz_record input: selector, mode, max_nbytes, then the record.
std::string record_input(int max_ndim, bool raw, std::uint64_t max_nbytes, const td::DynamicRecord& rec) {
  std::vector<char> buf(td::record_size_for(max_ndim));
  const std::size_t used = td::encode_record(rec, max_ndim, buf.data());
  std::string s;
  s.push_back(static_cast<char>(max_ndim + 1));
  s.push_back(raw ? 1 : 0);
  s.append(reinterpret_cast<const char*>(&max_nbytes), 8);
  s.append(buf.data(), raw ? buf.size() - 64 : used);  // padded mode: the harness zero-fills the rest
  return s;
}

td::DynamicRecord record(DType dtype, std::vector<std::int64_t> shape) {
  td::DynamicRecord r;
  r.spec.dtype = dtype;
  r.spec.shape = std::move(shape);
  r.nbytes = r.spec.nbytes();
  r.address = 0x7f0000001000ULL;
  r.device_id = 9;
  if (r.nbytes) r.rkey = std::string(97, '\x2a');
  return r;
}

// A socket frame (fuzz_frame): prefix, header, then `sent` bytes of a
// payload announced as `length` (all of it by default).
std::string frame(const std::string& header, std::uint64_t length, std::size_t sent) {
  std::string f = tensorwire::net::encode_prefix(header.size(), length) + header;
  for (std::size_t i = 0; i < sent; ++i) f.push_back(static_cast<char>(i * 7 + 1));
  return f;
}
std::string frame(const std::string& header, std::size_t length = 0) { return frame(header, length, length); }

td::DataHeader data_header(td::MsgKind kind, std::uint64_t a = 0, std::uint64_t b = 0) {
  td::DataHeader h;
  h.kind = kind;
  h.token = 0x5eed5eed5eed5eedULL;
  h.target = 3;
  h.a = a;
  h.b = b;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (writes CORPUS_DIR/<target>/seed-*)\n", argv[0]);
    return 2;
  }
  out_dir = argv[1];

  write("region", "host", descriptor(MemoryType::kHost, 0x7f0012345000ULL, 1 << 20, "rkey").to_bytes());
  write("region", "cuda", descriptor(MemoryType::kCuda, 0x100000, 4096, std::string(200, 'k')).to_bytes());
  write("region", "to-the-top", descriptor(MemoryType::kHost, 1, ~std::uint64_t(0) - 1, "r").to_bytes());

  const std::string desc = descriptor(MemoryType::kHost, 0x1000, 64, "rkey").to_bytes();
  write("control", "hello", message(ctl::MsgType::kHello, ctl::encode_hello(hello(2, "s3cret"))));
  write("control", "hello-v2", message(ctl::MsgType::kHello, "a future layout", ctl::Status::kOk, 2));
  write("control", "hello-reply", message(ctl::MsgType::kHelloReply, ctl::encode_hello(hello(1, ""))));
  write("control", "lookup", message(ctl::MsgType::kLookup, "tw.dynamic/inbox"));
  write("control", "lookup-reply", message(ctl::MsgType::kLookupReply, desc));
  write("control", "lookup-not-found", message(ctl::MsgType::kLookupReply, "no region", ctl::Status::kNotFound));
  td::ByteWriter attach;  // a slot attach: sender device id, its ack block's descriptor
  attach.put<std::uint64_t>(7);
  attach.put_bytes32(desc);
  td::ByteWriter call;
  call.put_bytes16("tw.static/slot");
  call.put_bytes32(attach.str());
  write("control", "call", message(ctl::MsgType::kCall, call.str()));
  write("control", "call-reply", message(ctl::MsgType::kCallReply, "result"));
  td::ByteWriter export_call;
  export_call.put_bytes16(ctl::kExportCall);
  export_call.put_bytes32(desc);
  write("control", "call-export", message(ctl::MsgType::kCall, export_call.str()));
  write("control", "ping", message(ctl::MsgType::kPing, ""));
  write("control", "pong", message(ctl::MsgType::kPong, ""));

  write("hello", "one-worker", ctl::encode_hello(hello(1, "")));
  write("hello", "three-workers", ctl::encode_hello(hello(3, "token")));
  write("hello", "trailing", ctl::encode_hello(hello(1, "t")) + "appended field");
  ctl::Hello self = hello(1, "");
  self.self_proof = std::string(32, '\x5c');
  write("hello", "self-proof", ctl::encode_hello(self));

  const std::uint64_t lots = std::uint64_t(1) << 32;
  const DType dtypes[] = {{0, 8},  {0, 16}, {0, 32}, {0, 64}, {1, 8},  {1, 16}, {1, 32},
                          {1, 64}, {2, 16}, {2, 32}, {2, 64}, {4, 16}, {6, 8}};
  for (const DType& dt : dtypes) {
    write("record", dt.name(), record_input(8, false, lots, record(dt, {3, 5})));
  }
  write("record", "scalar-ndim0", record_input(0, false, lots, record({2, 32}, {})));
  write("record", "empty", record_input(4, false, lots, record({2, 32}, {0, 7})));
  write("record", "ndim64-raw", record_input(64, true, lots, record({6, 8}, std::vector<std::int64_t>(64, 1))));
  write("record", "at-limit", record_input(2, false, 4096, record({1, 8}, {64, 64})));

  // fuzz_frame: the byte stream a data lane receives.
  td::LaneIntro intro;
  intro.version = ctl::kProtocolVersion;
  intro.worker = 1;
  intro.lane = 2;
  intro.token = 0x5eed5eed5eed5eedULL;
  const std::string intro_frame = frame(intro.encode());
  const std::string put_frame = frame(data_header(td::MsgKind::kPut, 0x7f0000001000ULL).encode(), 32);
  write("frame", "lane-intro", intro_frame);
  write("frame", "put", put_frame);
  std::string flag(8, '\0');
  flag[0] = 1;
  write("frame", "put-flagged",
        frame(data_header(td::MsgKind::kPutFlagged, 0x7f0000001000ULL, 0x7f0000002000ULL).encode(flag), 16));
  write("frame", "get", frame(data_header(td::MsgKind::kGet, 0x7f0000001000ULL, 64).encode()));
  write("frame", "get-data", frame(data_header(td::MsgKind::kGetData).encode(), 64));
  write("frame", "put-done", frame(data_header(td::MsgKind::kPutDone).encode()));
  write("frame", "static-send", frame(data_header(td::MsgKind::kStaticSend, 5).encode(), 48));
  write("frame", "static-release", frame(data_header(td::MsgKind::kStaticRelease, 5).encode()));
  write("frame", "wake", frame(data_header(td::MsgKind::kWake, 6).encode()));
  {
    const td::DynamicRecord rec = record({2, 32}, {2, 3});
    td::DynamicRecord inl = rec;
    inl.address = 0;
    inl.rkey.clear();
    std::vector<char> buf(td::record_size_for(4));
    buf.resize(td::encode_record(inl, 4, buf.data(), td::RecordForm::kInlineData));
    const std::string extra(buf.data(), buf.size());
    write("frame", "dynamic-send", frame(data_header(td::MsgKind::kDynamicSend, 1, 0).encode(extra), inl.nbytes));
    write("frame", "dynamic-send-placed",
          frame(data_header(td::MsgKind::kDynamicSend, 1, td::kPlacedSend).encode(extra)));
    td::ByteWriter offer;
    offer.put_bytes32(descriptor(MemoryType::kHost, 0x7f0000003000ULL, 24, "rkey").to_bytes());
    offer.put<std::uint64_t>(24);
    write("frame", "dynamic-ack", frame(data_header(td::MsgKind::kDynamicAck, 1, td::kAccepted).encode(offer.str())));
  }
  write("frame", "two-frames", intro_frame + put_frame);
  write("frame", "empty-header", frame("", 5));
  // Streamed payloads (> kEagerMax), cut short by EOF: one the harness lands, one it discards.
  const std::string big_header = data_header(td::MsgKind::kPut, 0x7f0000001000ULL).encode();
  write("frame", "streamed-landed", intro_frame + frame(big_header, tensorwire::net::kEagerMax + 100, 1000));
  write("frame", "streamed-discarded", frame(big_header, std::uint64_t(1) << 20, 2000));
  // An eager payload (at kEagerMax) cut short: never delivered.
  write("frame", "eager-truncated", put_frame + frame(big_header, tensorwire::net::kEagerMax, 500));
  // A frame, then a bad magic: a protocol error.
  write("frame", "bad-magic", put_frame + "TWXX" + std::string(12, '\0'));
  return 0;
}
