// Copyright tensorwire authors.
//
// Two Devices in one process, talking over 127.0.0.1: connection set-up,
// publish/lookup, one-sided write/read, calls, lanes, and refused
// connections. The data-path suite runs for every transport x progress mode.
//
// Inline mode: no thread progresses a device's workers; whoever waits drives
// them. A tcp put only lands when the *target* worker progresses, so while an
// inline client waits, a Pump thread drives the server's workers (the control
// plane has its own thread in every mode).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/device_impl.h"  // the message form's internals: a forged region bypasses the initiator's checks
#include "protocol/dynamic_record.h"
#include "tensorwire/channel.h"
#include "tensorwire/device.h"
#include "tensorwire/error.h"
#include "tensorwire/memory.h"
#include "tensorwire/region.h"
#include "tensorwire/slot.h"
#include "tensorwire/wait.h"

namespace tw = tensorwire;

namespace {

constexpr double kWait = 10.0;                         // every wait is bounded
constexpr std::size_t kRegion = std::size_t(2) << 20;  // 2 MiB target/source blocks

// Environment for every device of this binary, set before the first one is
// created. Only 127.0.0.1 is used, over the loopback interface (see
// make_config). (UCX_* globals such as UCX_WARN_UNUSED_ENV_VARS cannot be set
// here: UCX reads them when it is loaded, before this runs.)
const bool kEnvReady = [] {
  setenv("TENSORWIRE_LOG", "error", 0);  // refusals below are expected; keep logs short
  return true;
}();

const char* mode_name(tw::ProgressMode m) {
  switch (m) {
    case tw::ProgressMode::kBlocking: return "blocking";
    case tw::ProgressMode::kPolling: return "polling";
    case tw::ProgressMode::kInline: return "inline";
  }
  return "?";
}

tw::DeviceConfig make_config(const std::string& transport, tw::ProgressMode mode, int workers = 1) {
  tw::DeviceConfig c;
  c.host = "127.0.0.1";
  c.net_devices = "lo";  // as "auto" does for 127.0.0.1, but even when UCX_NET_DEVICES is set
  c.transport = transport;
  c.progress = mode;
  c.workers = workers;
  c.slab_size = std::size_t(8) << 20;
  c.connect_timeout_s = 5.0;
  return c;
}

// Drives a device's workers from a thread while it lives, in inline mode only
// (other modes have their own progress threads).
class Pump {
 public:
  explicit Pump(tw::Device& device) {
    if (device.config().progress != tw::ProgressMode::kInline) return;
    thread_ = std::thread([this, &device] {
      while (!stop_.load(std::memory_order_acquire)) {
        if (device.progress() == 0) std::this_thread::yield();
      }
    });
  }
  ~Pump() { stop(); }
  void stop() {
    stop_.store(true, std::memory_order_release);
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

unsigned char* bytes(const tw::Block& b) { return static_cast<unsigned char*>(b.data()); }

void fill_pattern(void* p, std::size_t n, unsigned seed) {
  auto* c = static_cast<unsigned char*>(p);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    c[i] = static_cast<unsigned char>(x >> 24);
  }
}

// First differing offset, or -1.
long first_diff(const void* a, const void* b, std::size_t n) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    if (x[i] != y[i]) return static_cast<long>(i);
  }
  return -1;
}

bool all_equal(const void* p, std::size_t n, unsigned char v) {
  const auto* c = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (c[i] != v) return false;
  }
  return true;
}

using Param = std::tuple<std::string, tw::ProgressMode>;

class Loopback : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kEnvReady);
    start(1);
  }
  void TearDown() override { stop(); }

  void start(int workers) {
    stop();
    const auto& [transport, mode] = GetParam();
    server = std::make_unique<tw::Device>(make_config(transport, mode, workers));
    client = std::make_unique<tw::Device>(make_config(transport, mode, workers));
    pump = std::make_unique<Pump>(*server);
    target = server->allocate(kRegion);
    source = client->allocate(kRegion);
    std::memset(target.data(), 0xa5, target.size());
    std::memset(source.data(), 0, source.size());
    server->publish("target", target.descriptor());
  }

  // start() with these environment variables set while the devices read
  // them (their construction), then restored.
  void start_with(int workers, const std::vector<std::pair<std::string, std::string>>& env) {
    std::vector<std::pair<std::string, std::optional<std::string>>> saved;
    for (const auto& [name, value] : env) {
      const char* was = std::getenv(name.c_str());
      saved.emplace_back(name, was ? std::optional<std::string>(was) : std::nullopt);
      setenv(name.c_str(), value.c_str(), 1);
    }
    start(workers);
    for (const auto& [name, was] : saved) {
      if (was)
        setenv(name.c_str(), was->c_str(), 1);
      else
        unsetenv(name.c_str());
    }
  }

  void stop() {
    pump.reset();
    if (client) client->close();
    if (server) server->close();
    source = tw::Block();
    target = tw::Block();
    client.reset();
    server.reset();
  }

  tw::ProgressMode mode() const { return std::get<1>(GetParam()); }

  std::unique_ptr<tw::Device> server, client;
  std::unique_ptr<Pump> pump;
  tw::Block target, source;
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param) + "_" + mode_name(std::get<1>(info.param));
}

}  // namespace

namespace {

// Watches a word the peer writes until it holds `value` (at most kWait),
// driving the sending side through `drive` meanwhile (the target of a tcp
// write needs its initiator's progress too).
void watch_word(volatile std::uint64_t* word, std::uint64_t value, tw::Request& drive) {
  auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(kWait);
  while (*word != value && std::chrono::steady_clock::now() < until) {
    drive.test();
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

TEST_P(Loopback, ConnectAndPeers) {
  tw::Channel ch = client->connect(server->address());
  EXPECT_EQ(ch.lane(), 0);
  tw::PeerInfo p = ch.peer();
  EXPECT_EQ(p.device_id, server->id());
  EXPECT_EQ(p.address, server->address());
  EXPECT_EQ(p.workers, 1);
  EXPECT_TRUE(p.same_host);
  // The data endpoint uses the transport asked for, and nothing else.
  const std::string info = ch.transport_info();
  if (std::get<0>(GetParam()) == "tcp") {
    EXPECT_NE(info.find("tcp/"), std::string::npos) << info;
  } else {
    EXPECT_EQ(info.find("tcp/"), std::string::npos) << info;
    EXPECT_TRUE(info.find("posix/") != std::string::npos || info.find("sysv/") != std::string::npos ||
                info.find("cma/") != std::string::npos || info.find("xpmem/") != std::string::npos)
        << info;
  }

  // The server learns about the client.
  tw::PeerInfo back = server->wait_for_peer(kWait);
  EXPECT_EQ(back.device_id, client->id());
  EXPECT_EQ(back.address, client->address());
  EXPECT_TRUE(back.same_host);
  ASSERT_EQ(server->peers().size(), 1u);
  EXPECT_EQ(server->peers()[0].device_id, client->id());

  // A second connect to the same address reuses the connection.
  tw::Channel again = client->connect(server->address());
  EXPECT_EQ(again.peer().device_id, server->id());
  EXPECT_EQ(client->peers().size(), 1u);
  EXPECT_EQ(server->peers().size(), 1u);
  EXPECT_THROW(server->wait_for_peer(0.2), tw::Timeout);
}

TEST_P(Loopback, PublishLookup) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion r = ch.lookup("target", kWait);
  ASSERT_TRUE(r);
  EXPECT_EQ(r.descriptor(), target.descriptor());
  EXPECT_EQ(r.address(), reinterpret_cast<std::uint64_t>(target.data()));
  EXPECT_EQ(r.length(), target.size());

  // Unknown names, and names after unpublish, are NotFound.
  EXPECT_THROW(ch.lookup("no-such-region", kWait), tw::NotFound);
  server->unpublish("target");
  EXPECT_THROW(ch.lookup("target", kWait), tw::NotFound);

  // Publishing again under a name replaces the region.
  tw::Block other = server->allocate(4096);
  server->publish("target", other.descriptor());
  tw::RemoteRegion r2 = ch.lookup("target", kWait);
  EXPECT_EQ(r2.length(), other.size());
  EXPECT_EQ(r2.address(), reinterpret_cast<std::uint64_t>(other.data()));

  EXPECT_THROW(server->publish("", other.descriptor()), tw::InvalidArgument);
}

TEST_P(Loopback, WriteAndReadSizes) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  const std::size_t local_off = 64, remote_off = 4096 + 128;
  unsigned seed = 1;
  for (std::size_t n : {std::size_t(1), std::size_t(4096), std::size_t(1) << 20}) {
    SCOPED_TRACE("size " + std::to_string(n));
    // write: client -> server
    std::memset(target.data(), 0xa5, target.size());
    fill_pattern(bytes(source) + local_off, n, seed++);
    ch.write(source.region(), local_off, remote, remote_off, n).wait(kWait);
    ch.flush().wait(kWait);
    EXPECT_EQ(first_diff(bytes(target) + remote_off, bytes(source) + local_off, n), -1);
    EXPECT_TRUE(all_equal(bytes(target), remote_off, 0xa5)) << "bytes before the range changed";
    EXPECT_TRUE(all_equal(bytes(target) + remote_off + n, target.size() - remote_off - n, 0xa5))
        << "bytes after the range changed";

    // read: server -> client
    std::memset(source.data(), 0, source.size());
    fill_pattern(bytes(target) + remote_off, n, seed++);
    ch.read(source.region(), local_off, remote, remote_off, n).wait(kWait);
    EXPECT_EQ(first_diff(bytes(source) + local_off, bytes(target) + remote_off, n), -1);
    EXPECT_TRUE(all_equal(bytes(source), local_off, 0));
    EXPECT_TRUE(all_equal(bytes(source) + local_off + n, source.size() - local_off - n, 0));
  }
}

// A batch posts many transfers as one request; a bad item refuses the whole
// batch before anything is posted.
TEST_P(Loopback, WriteAndReadBatches) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  constexpr std::size_t kItems = 200, kItem = 512;
  ASSERT_GE(target.size(), kItems * kItem);
  std::memset(target.data(), 0, target.size());
  fill_pattern(bytes(source), kItems * kItem, 11);
  std::vector<tw::Transfer> writes;
  for (std::size_t i = 0; i < kItems; ++i) {  // item i to slot kItems-1-i: the offsets matter
    writes.push_back({source.region(), i * kItem, remote, (kItems - 1 - i) * kItem, kItem});
  }
  ch.write_batch(writes).wait(kWait);
  ch.flush().wait(kWait);
  for (std::size_t i = 0; i < kItems; ++i) {
    ASSERT_EQ(first_diff(bytes(target) + (kItems - 1 - i) * kItem, bytes(source) + i * kItem, kItem), -1) << i;
  }
  std::memset(source.data(), 0, kItems * kItem);
  std::vector<tw::Transfer> reads;
  for (std::size_t i = 0; i < kItems; ++i) reads.push_back({source.region(), i * kItem, remote, i * kItem, kItem});
  ch.read_batch(reads).wait(kWait);
  EXPECT_EQ(first_diff(bytes(source), bytes(target), kItems * kItem), -1);

  std::memset(target.data(), 0x5a, target.size());
  writes.push_back({source.region(), 0, remote, target.size() - 8, 64});  // runs past the region
  EXPECT_THROW(ch.write_batch(writes), tw::InvalidArgument);
  ch.flush().wait(kWait);
  EXPECT_TRUE(all_equal(bytes(target), target.size(), 0x5a)) << "a refused batch wrote something";
}

// write_flagged: the flag lands after every byte of the data (one message
// where the target places writes; an eager one and one by rendezvous).
TEST_P(Loopback, WriteFlaggedLandsDataBeforeFlag) {
  if (mode() == tw::ProgressMode::kInline) GTEST_SKIP() << "inline mode: the target's worker needs a driver";
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  constexpr std::size_t kFlag = kRegion - 8;
  auto* flag_src = reinterpret_cast<std::uint64_t*>(bytes(source) + kFlag);
  auto* flag_dst = reinterpret_cast<volatile std::uint64_t*>(bytes(target) + kFlag);
  std::uint64_t round = 0;
  // landed = false: unanswered on a tcp lane (the flag is the only news); the same elsewhere
  for (bool landed : {true, false}) {
    for (std::size_t payload : {std::size_t{64}, std::size_t{8192}, kRegion - 64}) {
      for (int k = 0; k < 4; ++k) {
        ++round;
        fill_pattern(source.data(), payload, static_cast<int>(round));
        *flag_src = round;
        tw::Request both = ch.write_flagged(source.region(), 0, remote, 0, payload, kFlag, kFlag, landed);
        both.wait(kWait);  // the source may change once it completes: landed or not, the target gets these bytes
        fill_pattern(source.data(), payload, static_cast<int>(round) + 1000);
        watch_word(flag_dst, round, both);
        ASSERT_EQ(*flag_dst, round) << payload << " B";
        std::atomic_thread_fence(std::memory_order_acquire);
        fill_pattern(source.data(), payload, static_cast<int>(round));
        ASSERT_EQ(first_diff(target.data(), source.data(), payload), -1)
            << payload << " B, round " << round << (landed ? "" : ", unanswered");
      }
    }
  }
  EXPECT_THROW(ch.write_flagged(source.region(), 0, remote, 0, 64, kFlag, kFlag - 4), tw::InvalidArgument);
}

// In the message form (tcp by default) the *target* checks every write and
// read against what it exported to that peer (contracts §11, §12), even when
// a lying initiator skipped its own checks: nothing lands, nothing is read,
// the request fails with InvalidArgument, and the target counts the refusal.
TEST_P(Loopback, TargetRefusesUnexportedMessageAccess) {
  start_with(1, {{"TENSORWIRE_LANE_FORM", "messages"}});  // on every transport
  tw::Channel ch = client->connect(server->address());
  ASSERT_TRUE(ch.impl()->lane().rma_is_messages());
  tw::RemoteRegion exported = ch.lookup("target", kWait);
  tw::Block secret = server->allocate(4096);
  std::memset(secret.data(), 0x5a, secret.size());
  auto forged = [&](tw::RegionDescriptor d) {
    return tw::RemoteRegion(std::make_shared<tw::detail::RemoteRegionImpl>(std::move(d)));
  };
  tw::RegionDescriptor beyond = target.descriptor();
  beyond.length += 8192;  // the exported block, stretched past its end
  const auto refused_before = server->impl()->message_refusals();
  fill_pattern(source.data(), 4096, 9);
  const std::vector<unsigned char> before(bytes(source), bytes(source) + 4096);
  for (const tw::RemoteRegion& bad : {forged(secret.descriptor()), forged(beyond)}) {
    const std::size_t off = bad.length() > target.size() ? target.size() : 0;
    EXPECT_THROW(ch.write(source.region(), 0, bad, off, 4096).wait(kWait), tw::InvalidArgument);
    EXPECT_THROW(ch.read(source.region(), 0, bad, off, 4096).wait(kWait), tw::InvalidArgument);
  }
  EXPECT_TRUE(all_equal(secret.data(), secret.size(), 0x5a)) << "a refused write landed";
  EXPECT_EQ(first_diff(source.data(), before.data(), 4096), -1) << "a refused read changed the destination";
  // Data inside the export, its flag beyond it: refused whole (not even the data lands).
  std::memset(target.data(), 0, 4096);
  EXPECT_THROW(ch.write_flagged(source.region(), 0, forged(beyond), 0, 4096, 0, target.size() + 64).wait(kWait),
               tw::InvalidArgument);
  EXPECT_TRUE(all_equal(target.data(), 4096, 0)) << "the data of a refused flagged write landed";
  EXPECT_EQ(server->impl()->message_refusals(), refused_before + 5);
  // Unanswered (a tcp lane): the target refuses it alike and says nothing; elsewhere it is answered.
  try {
    ch.write_flagged(source.region(), 0, forged(beyond), 0, 4096, 0, target.size() + 64, /*landed=*/false).wait(kWait);
  } catch (const tw::InvalidArgument&) {
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (server->impl()->message_refusals() < refused_before + 6 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(server->impl()->message_refusals(), refused_before + 6);
  EXPECT_TRUE(all_equal(target.data(), 4096, 0)) << "the data of a refused unanswered flagged write landed";
  // The channel stays usable for what was exported.
  ch.write(source.region(), 0, exported, 0, 4096).wait(kWait);
  EXPECT_EQ(first_diff(target.data(), source.data(), 4096), -1);
}

// The message form's dynamic send carries its record inline (contracts §12).
// A lying one is refused by the receiver's recv() with the matching error,
// the lie's payload is dropped, and the slot takes the next tensor intact.
TEST_P(Loopback, MessageFormRefusesLyingRecords) {
  namespace td = tw::detail;
  start_with(1, {{"TENSORWIRE_LANE_FORM", "messages"}});
  const int max_ndim = 4;
  tw::DynamicSlot slot(*server, "lies", max_ndim, std::size_t(1) << 20);
  tw::Channel ch = client->connect(server->address());
  // Attach by hand (ack block, no sink of ours): the reply ends with the slot's
  // message id and the memory type of its tensors (one byte, §10.4).
  tw::Block ack = client->allocate(4096);
  td::ByteWriter w;
  w.put_bytes32(client->impl()->export_for(ack.descriptor(), *ch.impl()->peer).to_bytes());
  w.put<std::uint64_t>(0);
  const std::string reply = ch.call("tw.dynamic/lies", w.str(), kWait);
  std::uint64_t slot_sink = 0;
  std::memcpy(&slot_sink, reply.data() + reply.size() - 9, 8);

  auto send = [&](const td::DynamicRecord& rec, std::size_t payload, td::RecordForm form, bool placed = false) {
    std::string extra(td::record_size_for(max_ndim), '\0');
    extra.resize(td::encode_record(rec, max_ndim, extra.data(), form));
    td::DataHeader h;
    h.kind = td::MsgKind::kDynamicSend;
    h.target = slot_sink;
    h.a = slot.next_seq();
    h.b = placed ? td::kPlacedSend : 0;
    const tw::LocalRegion src = source.region();
    ch.impl()->send_message(h, extra, &src, 0, payload).wait(kWait);
  };
  auto good = [](std::int64_t n) {
    td::DynamicRecord r;
    r.spec.dtype = tw::DType{0, 64};
    r.spec.shape = {n};
    r.nbytes = 8 * static_cast<std::uint64_t>(n);
    return r;
  };
  struct Lie {
    const char* what;
    td::DynamicRecord rec;
    std::size_t payload;
    td::RecordForm form;
    tw::ErrorKind kind;
    bool placed = false;  // says its payload was put into a block the slot offered (§12)
  };
  std::vector<Lie> lies;
  {
    auto r = good(8);
    r.address = 0x10000;
    r.rkey = "key";
    lies.push_back({"names memory", r, 64, td::RecordForm::kRemoteData, tw::ErrorKind::kInvalidArgument});
  }
  lies.push_back(
      {"payload shorter than nbytes", good(8), 56, td::RecordForm::kInlineData, tw::ErrorKind::kInvalidArgument});
  {
    auto r = good(8);
    r.nbytes = 4096;  // not the shape's
    lies.push_back({"nbytes not the shape's", r, 4096, td::RecordForm::kInlineData, tw::ErrorKind::kInvalidArgument});
  }
  lies.push_back({"over max_nbytes", good(std::int64_t(1) << 18), std::size_t(2) << 20, td::RecordForm::kInlineData,
                  tw::ErrorKind::kInvalidArgument});
  {
    auto r = good(8);
    r.spec.dtype = tw::DType{9, 64};
    lies.push_back({"unknown dtype", r, 64, td::RecordForm::kInlineData, tw::ErrorKind::kInvalidArgument});
  }
  // Placed, but this slot offered no block (none for a tensor of 64 bytes).
  lies.push_back(
      {"placed without an offer", good(8), 0, td::RecordForm::kInlineData, tw::ErrorKind::kInvalidArgument, true});
  ASSERT_GE(source.size(), std::size_t(2) << 20);
  const std::size_t in_use_before = server->pool().stats().bytes_in_use;
  for (const Lie& lie : lies) {
    SCOPED_TRACE(lie.what);
    send(lie.rec, lie.payload, lie.form, lie.placed);
    tw::TensorSpec spec;
    try {
      slot.recv(&spec, kWait);
      ADD_FAILURE() << "a lying record was accepted";
    } catch (const tw::Error& e) {
      EXPECT_EQ(e.kind(), lie.kind) << e.what();
    }
    EXPECT_EQ(server->pool().stats().bytes_in_use, in_use_before) << "a refused tensor kept memory";
    // The slot goes on: the next tensor arrives intact.
    fill_pattern(source.data(), 64, 3);
    send(good(8), 64, td::RecordForm::kInlineData);
    tw::Block got = slot.recv(&spec, kWait);
    ASSERT_EQ(got.size(), 64u);
    EXPECT_EQ(first_diff(got.data(), source.data(), 64), -1);
  }
  EXPECT_EQ(slot.stats().rejected, lies.size());
  EXPECT_EQ(slot.stats().received, lies.size());
}

TEST_P(Loopback, WholeRegionAndZeroLength) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  fill_pattern(source.data(), source.size(), 77);
  ch.write(source.region(), 0, remote, 0, target.size()).wait(kWait);
  ch.flush().wait(kWait);
  EXPECT_EQ(first_diff(target.data(), source.data(), target.size()), -1);
  // A zero-length operation at the very end is valid and completes at once.
  tw::Request z = ch.write(source.region(), source.size(), remote, target.size(), 0);
  EXPECT_EQ(z.state(), 1);
  z.wait(kWait);
}

TEST_P(Loopback, WriteFromRegisteredMemory) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  std::vector<unsigned char> outside(256 * 1024);
  fill_pattern(outside.data(), outside.size(), 5);
  tw::Registration reg = client->pool().register_memory(outside.data(), outside.size());
  ch.write(reg.region(), 0, remote, 8192, outside.size()).wait(kWait);
  ch.flush().wait(kWait);
  EXPECT_EQ(first_diff(bytes(target) + 8192, outside.data(), outside.size()), -1);
  // And read back into a registered sub-range (a cache hit).
  std::memset(outside.data(), 0, outside.size());
  tw::Registration sub = client->pool().register_memory(outside.data() + 1000, 5000);
  ch.read(sub.region(), 0, remote, 8192 + 1000, 5000).wait(kWait);
  EXPECT_EQ(first_diff(outside.data() + 1000, bytes(target) + 8192 + 1000, 5000), -1);
  EXPECT_TRUE(all_equal(outside.data(), 1000, 0));
  EXPECT_TRUE(all_equal(outside.data() + 6000, outside.size() - 6000, 0));
  EXPECT_THROW(ch.read(sub.region(), 0, remote, 0, 5001), tw::InvalidArgument);
}

TEST_P(Loopback, OutOfRangeIsRejected) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  const std::size_t L = source.size(), R = target.size();
  fill_pattern(source.data(), L, 9);
  std::vector<unsigned char> before(bytes(target), bytes(target) + R);
  const std::size_t kMax = static_cast<std::size_t>(-1);
  struct Case {
    std::size_t local_off, remote_off, len;
  };
  const Case cases[] = {
      {L - 10, 0, 11},   // local range past the end
      {L, 0, 1},         // local offset at the end
      {kMax, 0, 2},      // local offset + length wraps
      {0, R - 10, 11},   // remote range past the end
      {0, R + 1, 0},     // remote offset past the end, empty
      {0, kMax - 1, 4},  // remote offset + length wraps
      {0, 0, L + 1},     // longer than both
      {0, 0, kMax},      // absurd length
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("local_off " + std::to_string(c.local_off) + " remote_off " + std::to_string(c.remote_off) + " len " +
                 std::to_string(c.len));
    EXPECT_THROW(ch.write(source.region(), c.local_off, remote, c.remote_off, c.len), tw::InvalidArgument);
    EXPECT_THROW(ch.read(source.region(), c.local_off, remote, c.remote_off, c.len), tw::InvalidArgument);
  }
  // A region that is not registered, or an empty remote region.
  tw::LocalRegion unregistered{source.data(), 64, nullptr, nullptr};
  EXPECT_THROW(ch.write(unregistered, 0, remote, 0, 64), tw::InvalidArgument);
  EXPECT_THROW(ch.write(source.region(), 0, tw::RemoteRegion(), 0, 64), tw::InvalidArgument);
  // A remote region of another device (the client's own block) is refused.
  tw::RemoteRegion foreign;
  {
    // Reach the client's own region through a reverse channel's lookup.
    client->publish("mine", source.descriptor());
    server->wait_for_peer(kWait);
    tw::Channel back = server->channel_to(client->id());
    foreign = back.lookup("mine", kWait);
  }
  EXPECT_THROW(ch.write(source.region(), 0, foreign, 0, 64), tw::InvalidArgument);

  // Nothing reached the target.
  ch.flush().wait(kWait);
  EXPECT_EQ(first_diff(target.data(), before.data(), R), -1);
  // The channel still works afterwards.
  ch.write(source.region(), 0, remote, 0, 100).wait(kWait);
  ch.flush().wait(kWait);
  EXPECT_EQ(first_diff(target.data(), source.data(), 100), -1);
}

TEST_P(Loopback, ManyRequestsInFlight) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  constexpr std::size_t kN = 256, kSize = 4096;
  fill_pattern(source.data(), kN * kSize, 31);
  std::vector<tw::Request> reqs;
  reqs.reserve(kN);
  for (std::size_t i = 0; i < kN; ++i) {
    // Scatter: the i-th source chunk lands at a permuted offset.
    std::size_t dst = ((i * 97) % kN) * kSize;
    reqs.push_back(ch.write(source.region(), i * kSize, remote, dst, kSize));
  }
  for (auto& r : reqs) r.wait(kWait);
  ch.flush().wait(kWait);
  for (std::size_t i = 0; i < kN; ++i) {
    std::size_t dst = ((i * 97) % kN) * kSize;
    ASSERT_EQ(first_diff(bytes(target) + dst, bytes(source) + i * kSize, kSize), -1) << "chunk " << i;
  }
  EXPECT_TRUE(all_equal(bytes(target) + kN * kSize, target.size() - kN * kSize, 0xa5));

  // Many reads in flight, completed in reverse order of posting.
  std::memset(source.data(), 0, source.size());
  reqs.clear();
  for (std::size_t i = 0; i < kN; ++i) {
    reqs.push_back(ch.read(source.region(), i * kSize, remote, (kN - 1 - i) * kSize, kSize));
  }
  for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) it->wait(kWait);
  for (std::size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(first_diff(bytes(source) + i * kSize, bytes(target) + (kN - 1 - i) * kSize, kSize), -1) << "chunk " << i;
  }
}

TEST_P(Loopback, RequestCallbacks) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  fill_pattern(source.data(), 65536, 3);
  std::mutex mu;
  std::condition_variable cv;
  int fired = 0;
  bool all_ok = true;
  std::vector<tw::Request> reqs;
  for (int i = 0; i < 16; ++i) {
    reqs.push_back(ch.write(source.region(), i * 4096, remote, i * 4096, 4096));
    reqs.back().then([&](bool ok, const std::string&) {
      std::lock_guard<std::mutex> lock(mu);
      if (!ok) all_ok = false;
      ++fired;
      cv.notify_all();  // under the lock: the waiter below owns these variables
    });
  }
  for (auto& r : reqs) {
    r.wait(kWait);
    EXPECT_EQ(r.state(), 1);
    EXPECT_TRUE(r.test());
    EXPECT_EQ(r.error_message(), "");
  }
  // Every callback runs exactly once. Not necessarily before wait() returns:
  // the completing thread marks the request done, then runs the callback.
  {
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::duration<double>(kWait), [&] { return fired == 16; })) << fired;
    EXPECT_TRUE(all_ok);
  }
  // A callback added after completion runs at once, on this thread.
  bool late = false;
  reqs[0].then([&](bool ok, const std::string&) { late = ok; });
  EXPECT_TRUE(late);
  ch.flush().wait(kWait);
  EXPECT_EQ(first_diff(target.data(), source.data(), 65536), -1);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(fired, 16);
}

TEST_P(Loopback, FenceOrdersWrites) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  fill_pattern(source.data(), 1 << 20, 11);
  tw::Request data = ch.write(source.region(), 0, remote, 0, 1 << 20);
  ch.fence();
  bytes(source)[(1 << 20) + 64] = 0x01;
  tw::Request flag = ch.write(source.region(), (1 << 20) + 64, remote, (1 << 20) + 64, 1);
  data.wait(kWait);
  flag.wait(kWait);
  ch.flush().wait(kWait);
  EXPECT_EQ(bytes(target)[(1 << 20) + 64], 0x01);
  EXPECT_EQ(first_diff(target.data(), source.data(), 1 << 20), -1);
}

// A fence between small writes (eager messages where the target places
// writes: applied in order, so the fence returns without a round trip): a
// watcher that sees the flag sees the data.
TEST_P(Loopback, FenceOrdersSmallWritesSeenByAWatcher) {
  if (mode() == tw::ProgressMode::kInline) GTEST_SKIP() << "inline mode: the target's worker needs a driver";
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  constexpr std::size_t kFlag = kRegion - 8;
  auto* flag_src = reinterpret_cast<std::uint64_t*>(bytes(source) + kFlag);
  auto* flag_dst = reinterpret_cast<volatile std::uint64_t*>(bytes(target) + kFlag);
  for (std::uint64_t round = 1; round <= 16; ++round) {
    const std::size_t payload = round % 2 ? 4096 : 60000;
    fill_pattern(source.data(), payload, static_cast<int>(round));
    *flag_src = round;
    tw::Request data = ch.write(source.region(), 0, remote, 0, payload);
    ch.fence();
    tw::Request flag = ch.write(source.region(), kFlag, remote, kFlag, 8);
    watch_word(flag_dst, round, flag);
    ASSERT_EQ(*flag_dst, round);
    std::atomic_thread_fence(std::memory_order_acquire);
    ASSERT_EQ(first_diff(target.data(), source.data(), payload), -1) << "round " << round;
    data.wait(kWait);
    flag.wait(kWait);
  }
}

// write_ordered: once the flag is visible at the target, so is everything
// written before it (seen by a watcher of the target, not after a flush).
TEST_P(Loopback, WriteOrderedLandsAfterEarlierWrites) {
  if (mode() == tw::ProgressMode::kInline) GTEST_SKIP() << "inline mode: the target's worker needs a driver";
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  constexpr std::size_t kPayload = kRegion - 64;
  constexpr std::size_t kFlag = kRegion - 8;
  auto* flag_src = reinterpret_cast<std::uint64_t*>(bytes(source) + kFlag);
  auto* flag_dst = reinterpret_cast<volatile std::uint64_t*>(bytes(target) + kFlag);
  for (std::uint64_t round = 1; round <= 8; ++round) {
    fill_pattern(source.data(), kPayload, static_cast<int>(round));
    *flag_src = round;
    tw::Request data = ch.write(source.region(), 0, remote, 0, kPayload);
    tw::Request flag = ch.write_ordered(source.region(), kFlag, remote, kFlag, 8);
    watch_word(flag_dst, round, flag);
    ASSERT_EQ(*flag_dst, round);
    std::atomic_thread_fence(std::memory_order_acquire);
    ASSERT_EQ(first_diff(target.data(), source.data(), kPayload), -1) << "round " << round;
    data.wait(kWait);
    flag.wait(kWait);
  }
}

TEST_P(Loopback, Calls) {
  std::atomic<int> calls{0};
  server->on_call("echo", [&](const std::string& payload) {
    calls.fetch_add(1);
    return "echo:" + payload;
  });
  server->on_call("fail", [](const std::string&) -> std::string { throw std::runtime_error("handler broke"); });
  tw::Channel ch = client->connect(server->address());
  EXPECT_EQ(ch.call("echo", "hello", kWait), "echo:hello");
  EXPECT_EQ(ch.call("echo", "", kWait), "echo:");
  const std::string binary("\0\1\2\xff", 4);
  EXPECT_EQ(ch.call("echo", binary, kWait), "echo:" + binary);
  std::string big(64 * 1024, 'b');
  fill_pattern(big.data(), big.size(), 1);
  EXPECT_EQ(ch.call("echo", big, kWait), "echo:" + big);
  EXPECT_EQ(calls.load(), 4);

  EXPECT_THROW(ch.call("nobody-home", "x", kWait), tw::NotFound);
  try {
    ch.call("fail", "x", kWait);
    FAIL() << "expected an error from a throwing handler";
  } catch (const tw::Error& e) {
    EXPECT_NE(std::string(e.what()).find("handler broke"), std::string::npos) << e.what();
  }
  // A handler removed with an empty function is unknown again.
  server->on_call("echo", nullptr);
  EXPECT_THROW(ch.call("echo", "x", kWait), tw::NotFound);
  // A payload above the control-plane limit is refused before sending.
  EXPECT_THROW(ch.call("echo", std::string((1 << 20) + 1, 'x'), kWait), tw::InvalidArgument);
  // The connection survives all of that.
  server->on_call("echo", [](const std::string& p) { return p; });
  EXPECT_EQ(ch.call("echo", "still here", kWait), "still here");
}

TEST_P(Loopback, CallTimeoutThenLateReplyIsDropped) {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  server->on_call("slow", [&](const std::string& p) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return release; });  // bounded
    return "late:" + p;
  });
  server->on_call("fast", [](const std::string& p) { return p; });
  tw::Channel ch = client->connect(server->address());
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(ch.call("slow", "x", 0.3), tw::Timeout);
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(elapsed, 0.29);
  EXPECT_LT(elapsed, 5.0);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  // The late reply finds nobody waiting; the next calls get their own replies.
  EXPECT_EQ(ch.call("fast", "one", kWait), "one");
  EXPECT_EQ(ch.call("slow", "two", kWait), "late:two");
}

TEST_P(Loopback, PeerClosedFailsCallsAndPosts) {
  server->on_call("echo", [](const std::string& p) { return p; });
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  EXPECT_EQ(ch.call("echo", "up", kWait), "up");
  pump.reset();
  server->close();
  // The next control call fails (not a timeout): the peer closed.
  try {
    ch.call("echo", "down", kWait);
    FAIL() << "call to a closed peer succeeded";
  } catch (const tw::Error& e) {
    EXPECT_TRUE(e.kind() == tw::ErrorKind::kPeerFailed || e.kind() == tw::ErrorKind::kConnection)
        << static_cast<int>(e.kind()) << ": " << e.what();
  }
  // The failure reaches the peer table (bounded wait on its state).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!client->peers().empty() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_TRUE(client->peers().empty());
  EXPECT_THROW(ch.write(source.region(), 0, remote, 0, 64), tw::PeerFailed);
  EXPECT_THROW(ch.lookup("target", kWait), tw::PeerFailed);
  EXPECT_THROW(client->connect(server->address()), tw::ConnectionError);
  // The client device itself keeps working with another peer.
  const auto& [transport, m] = GetParam();
  tw::Device other(make_config(transport, m));
  Pump other_pump(other);
  tw::Block other_target = other.allocate(4096);
  other.publish("t", other_target.descriptor());
  tw::Channel ch2 = client->connect(other.address());
  tw::RemoteRegion r2 = ch2.lookup("t", kWait);
  fill_pattern(source.data(), 4096, 8);
  ch2.write(source.region(), 0, r2, 0, 4096).wait(kWait);
  ch2.flush().wait(kWait);
  EXPECT_EQ(first_diff(other_target.data(), source.data(), 4096), -1);
}

TEST_P(Loopback, CallsFromManyThreads) {
  server->on_call("double", [](const std::string& p) { return p + p; });
  tw::Channel ch = client->connect(server->address());
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        std::string p = std::to_string(t) + "/" + std::to_string(i);
        try {
          if (ch.call("double", p, kWait) != p + p) bad.fetch_add(1);
        } catch (const std::exception&) {
          bad.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

// Threads that post and wait on one worker at once, with its progress thread
// standing aside for them (WorkerCtl's handoff): nothing lost, no deadlock.
TEST_P(Loopback, WritesAndWaitsFromManyThreads) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  constexpr int kThreads = 4;
  constexpr std::size_t kShare = kRegion / kThreads;
  fill_pattern(source.data(), kRegion, 57);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        // Each thread writes its share in pieces of growing size, waiting on
        // some and leaving others to the flush, then rewrites it whole.
        const std::size_t base = t * kShare;
        std::size_t off = 0;
        std::vector<tw::Request> pending;
        for (std::size_t piece = 64; off < kShare; piece *= 4) {
          const std::size_t n = std::min(piece, kShare - off);
          tw::Request r = ch.write(source.region(), base + off, remote, base + off, n);
          if ((off / 64) % 2 == 0)
            r.wait(kWait);
          else
            pending.push_back(std::move(r));
          off += n;
        }
        for (auto& r : pending) r.wait(kWait);
        ch.write(source.region(), base, remote, base, kShare).wait(kWait);
      } catch (const std::exception&) {
        errors.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(errors.load(), 0);
  ch.flush().wait(kWait);
  EXPECT_EQ(first_diff(bytes(target), bytes(source), kRegion), -1);
}

// A write left in flight by a thread that then stops driving the worker (it
// only sleeps) completes all the same: the progress thread takes it over.
TEST_P(Loopback, WorkLeftInFlightCompletesWithoutTheCaller) {
  if (mode() == tw::ProgressMode::kInline) GTEST_SKIP() << "inline mode: nobody else progresses, by design";
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  fill_pattern(source.data(), kRegion, 91);
  for (int round = 0; round < 20; ++round) {
    tw::Request r = ch.write(source.region(), 0, remote, 0, kRegion);
    tw::Request f = ch.flush();
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(kWait);
    while ((r.state() == 0 || f.state() == 0) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // state() never progresses
    }
    ASSERT_EQ(r.state(), 1) << "round " << round;
    ASSERT_EQ(f.state(), 1) << "round " << round;
  }
  EXPECT_EQ(first_diff(bytes(target), bytes(source), kRegion), -1);
}

TEST_P(Loopback, LanesWithTwoWorkers) {
  start(2);
  constexpr int kLanes = 4;
  constexpr std::size_t kSlice = 64 * 1024;
  std::vector<tw::Channel> channels;
  for (int lane = 0; lane < kLanes; ++lane) {
    channels.push_back(client->connect(server->address(), lane));
    EXPECT_EQ(channels.back().lane(), lane);
    EXPECT_EQ(channels.back().peer().workers, 2);
  }
  EXPECT_EQ(client->peers().size(), 1u);  // one peer, four lanes
  EXPECT_THROW(client->connect(server->address(), -1), tw::InvalidArgument);
  tw::RemoteRegion remote = channels[0].lookup("target", kWait);
  fill_pattern(source.data(), kLanes * kSlice, 21);
  std::vector<tw::Request> reqs;
  for (int lane = 0; lane < kLanes; ++lane) {
    // Each lane looks the region up itself too: the rkey is unpacked per lane.
    tw::RemoteRegion r = lane % 2 ? channels[lane].lookup("target", kWait) : remote;
    reqs.push_back(channels[lane].write(source.region(), lane * kSlice, r, lane * kSlice, kSlice));
  }
  for (auto& r : reqs) r.wait(kWait);
  for (auto& ch : channels) ch.flush().wait(kWait);
  EXPECT_EQ(first_diff(target.data(), source.data(), kLanes * kSlice), -1);

  // Reads on every lane, each of another lane's slice.
  std::memset(source.data(), 0, source.size());
  reqs.clear();
  for (int lane = 0; lane < kLanes; ++lane) {
    int from = (lane + 1) % kLanes;
    reqs.push_back(channels[lane].read(source.region(), from * kSlice, remote, from * kSlice, kSlice));
  }
  for (auto& r : reqs) r.wait(kWait);
  EXPECT_EQ(first_diff(source.data(), target.data(), kLanes * kSlice), -1);
}

// wait_any (core/waiter.h): which of several slots has a tensor, a request's
// completion, the deadline, a dead sender.
TEST_P(Loopback, WaitAnySaysWhichSlotIsReady) {
  const tw::TensorSpec spec{{16}, tw::DType{2, 32}};
  tw::StaticSlot a(*server, "a", spec, 2), b(*server, "b", spec, 2);
  tw::DynamicSlot d(*server, "d");
  tw::Channel ch = client->connect(server->address());
  tw::StaticSender to_a(ch, "a", kWait), to_b(ch, "b", kWait);
  tw::DynamicSender to_d(ch, "d", kWait);
  // Inline: the dynamic slot's ack is an RMA write to the client (rma form over
  // tcp: its fence needs the client to progress while the server receives).
  Pump client_pump(*client);
  EXPECT_THROW(tw::wait_any({}, kWait), tw::InvalidArgument);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(tw::wait_any({a, b, d}, 0.05), tw::Timeout);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));

  fill_pattern(source.data(), 64, 1);
  to_b.send(source.region(), 0, spec, kWait).wait(kWait);
  EXPECT_EQ(tw::wait_any({a, b, d}, kWait), 1u);
  const int idx = b.recv(0);  // ready: no wait
  EXPECT_EQ(first_diff(b.buffer(idx), source.data(), 64), -1);
  b.release();

  tw::Request pending = to_d.send(source.region(), 0, spec, kWait);  // completes on the receiver's ack
  EXPECT_EQ(tw::wait_any({a, b, d}, kWait), 2u);
  tw::TensorSpec got;
  tw::Block blk = d.recv(&got, 0);
  EXPECT_EQ(got.describe(), spec.describe());
  EXPECT_EQ(first_diff(blk.data(), source.data(), 64), -1);
  EXPECT_EQ(tw::wait_any({pending}, kWait), 0u);
  EXPECT_NE(pending.state(), 0);
  pending.wait(0);

  to_a.send(source.region(), 0, spec, kWait).wait(kWait);
  EXPECT_EQ(tw::wait_any({b, a}, kWait), 1u);
  a.recv(0);
  a.release();
}

// A placed static send (contracts §12): the sender puts the tensor into its
// buffer and, once a flush says it landed, sends a header with no payload. A
// placed header that carries a payload or is for a slot whose window does not
// hold its size, an in-message header without a payload, or a form nobody
// defined is refused and counted; real placed sends arrive intact and are
// counted by their sender, and a slot outside the window gets none.
TEST_P(Loopback, PlacedStaticSendsAndTheirRules) {
  namespace td = tw::detail;
  start_with(1, {{"TENSORWIRE_LANE_FORM", "messages"}, {"TENSORWIRE_PLACE", "0-8192"}});
  const tw::TensorSpec spec{{1024}, tw::DType{2, 32}};   // 4 KiB: inside the window
  const tw::TensorSpec large{{4096}, tw::DType{2, 32}};  // 16 KiB: outside
  const std::size_t nbytes = spec.nbytes();
  tw::StaticSlot slot(*server, "placed", spec, 2);
  tw::StaticSlot outside(*server, "outside", large, 2);
  tw::Channel ch = client->connect(server->address());
  ASSERT_TRUE(ch.impl()->lane().rma_is_messages());
  // Attach by hand (ack block, no sink of ours): a host slot's reply ends with
  // its message id, the sizes it asks to be placed and its help area (§10.3).
  tw::Block ack = client->allocate(4096);
  auto attach = [&](const std::string& name) {
    td::ByteWriter w;
    w.put_bytes32(client->impl()->export_for(ack.descriptor(), *ch.impl()->peer).to_bytes());
    w.put<std::uint64_t>(0);
    const std::string reply = ch.call("tw.static/" + name, w.str(), kWait);
    std::uint64_t sink = 0, window[2] = {0, 0}, help_at = 0;
    std::memcpy(&sink, reply.data() + reply.size() - 32, 8);
    std::memcpy(window, reply.data() + reply.size() - 24, 16);
    std::memcpy(&help_at, reply.data() + reply.size() - 8, 8);
    const std::size_t n = (name == "placed" ? spec : large).nbytes();
    EXPECT_EQ(help_at, 2 * ((n + 63) / 64 * 64 + 64)) << name;  // after its two buffers
    EXPECT_EQ(window[0], 0u) << name;                           // TENSORWIRE_PLACE, as the server read it
    EXPECT_EQ(window[1], 8192u) << name;
    return sink;
  };
  const std::uint64_t slot_sink = attach("placed"), outside_sink = attach("outside");
  auto header = [&](std::uint64_t form, std::uint64_t sink = 0) {
    td::DataHeader h;
    h.kind = td::MsgKind::kStaticSend;
    h.target = sink ? sink : slot_sink;
    h.a = slot.next_seq();
    h.b = form;
    return h;
  };
  const auto refused_before = server->impl()->message_refusals();
  const tw::LocalRegion src = source.region();
  ch.impl()->send_message(header(td::kPlacedSend), {}, &src, 0, nbytes).wait(kWait);    // placed, yet a payload
  ch.impl()->send_message(header(0), {}, nullptr, 0, 0).wait(kWait);                    // in-message, no payload
  ch.impl()->send_message(header(td::kPlacedSend + 1), {}, nullptr, 0, 0).wait(kWait);  // an unknown form
  ch.impl()->send_message(header(td::kPlacedSend, outside_sink), {}, nullptr, 0, 0).wait(kWait);  // not asked for
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (server->impl()->message_refusals() < refused_before + 4 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(server->impl()->message_refusals(), refused_before + 4);
  EXPECT_EQ(slot.poll(), -1) << "a refused header delivered a tensor";
  EXPECT_EQ(outside.poll(), -1) << "a refused header delivered a tensor";

  tw::StaticSlot real(*server, "placed-real", spec, 2);  // "placed" keeps its hand-attached sender
  tw::StaticSender sender(ch, "placed-real", kWait);
  for (unsigned i = 0; i < 3; ++i) {
    fill_pattern(source.data(), nbytes, 30 + i);
    sender.send(source.region(), 0, spec, kWait).wait(kWait);
    const int idx = real.recv(kWait);
    EXPECT_EQ(first_diff(real.buffer(idx), source.data(), nbytes), -1) << "tensor " << i;
    real.release();
  }
  // A tcp lane (a socket) has no RMA to place with: its tensors travel in their messages.
  EXPECT_EQ(sender.stats().placed, ch.impl()->lane().one_sided() ? 3u : 0u);
  EXPECT_EQ(real.stats().received, 3u);
  // Outside the window: the tensor travels in its message.
  tw::StaticSlot real_large(*server, "outside-real", large, 2);
  tw::StaticSender large_sender(ch, "outside-real", kWait);
  fill_pattern(source.data(), large.nbytes(), 40);
  large_sender.send(source.region(), 0, large, kWait).wait(kWait);
  const int idx = real_large.recv(kWait);
  EXPECT_EQ(first_diff(real_large.buffer(idx), source.data(), large.nbytes()), -1);
  EXPECT_EQ(large_sender.stats().placed, 0u);
}

// A grant ends when its memory returns (contracts §11): a block exported to
// a peer and then freed, and a placed dynamic tensor once its receiver hands
// it to the user, are refused to that peer's message-form writes, also when
// the pool leases the same bytes again.
TEST_P(Loopback, GrantsEndWhenTheirMemoryReturns) {
  start_with(1, {{"TENSORWIRE_LANE_FORM", "messages"}, {"TENSORWIRE_PLACE", "0-65536"}});
  tw::Channel ch = client->connect(server->address());
  ASSERT_TRUE(ch.impl()->lane().rma_is_messages());
  Pump client_pump(*client);  // inline: the dynamic slot's acks reach the client while it waits elsewhere
  auto peer = server->impl()->peer_by_id(client->id());
  ASSERT_TRUE(peer);
  auto remote = [](tw::RegionDescriptor d) {
    return tw::RemoteRegion(std::make_shared<tw::detail::RemoteRegionImpl>(std::move(d)));
  };
  const std::size_t n = 4096;
  const auto refused_before = server->impl()->message_refusals();

  tw::Block exported = server->allocate(n);
  const tw::RegionDescriptor d = server->impl()->export_for(exported.descriptor(), *peer);
  fill_pattern(source.data(), n, 50);
  ch.write(source.region(), 0, remote(d), 0, n).wait(kWait);
  EXPECT_EQ(first_diff(exported.data(), source.data(), n), -1);
  exported = tw::Block();                  // freed: the grant ends
  tw::Block reused = server->allocate(n);  // first fit: the same bytes, leased again and not exported
  EXPECT_EQ(reinterpret_cast<std::uint64_t>(reused.data()), d.address);
  std::memset(reused.data(), 0x5a, n);
  EXPECT_THROW(ch.write(source.region(), 0, remote(d), 0, n).wait(kWait), tw::InvalidArgument);
  EXPECT_TRUE(all_equal(reused.data(), n, 0x5a)) << "a write through a freed block's grant landed";

  const tw::TensorSpec spec{{n / 4}, tw::DType{2, 32}};  // inside the window: placed into the offered block
  tw::DynamicSlot slot(*server, "handed");
  tw::DynamicSender sender(ch, "handed", kWait);
  std::vector<tw::Block> received;
  for (unsigned i = 0; i < 3; ++i) {  // the first travels in its message; its ack offers a block for the next
    fill_pattern(source.data(), n, 60 + i);
    tw::Request req = sender.send(source.region(), 0, spec, kWait);
    tw::TensorSpec got;
    received.push_back(slot.recv(&got, kWait));
    req.wait(kWait);
    EXPECT_EQ(first_diff(received.back().data(), source.data(), n), -1) << "tensor " << i;
  }
  ASSERT_EQ(sender.stats().placed, ch.impl()->lane().one_sided() ? 2u : 0u);  // a tcp lane places nothing (no RMA)
  for (unsigned i = 1; i < 3; ++i) {  // a placed tensor is the user's: its sender's grant ended
    std::memset(received[i].data(), 0x5a, n);
    tw::RegionDescriptor landed = d;
    landed.address = reinterpret_cast<std::uint64_t>(received[i].data());
    EXPECT_THROW(ch.write(source.region(), 0, remote(landed), 0, n).wait(kWait), tw::InvalidArgument);
    EXPECT_TRUE(all_equal(received[i].data(), n, 0x5a)) << "a write into a received tensor landed";
  }
  EXPECT_EQ(server->impl()->message_refusals(), refused_before + 3);
}

// A wait that naps on a one-sided word cuts the thread's timer slack for
// each nap (a 20 us nap would last 70) and gives the caller's back after.
TEST_P(Loopback, NappingWaitRestoresTheCallersTimerSlack) {
  const tw::TensorSpec spec{{16}, tw::DType{2, 32}};
  tw::StaticSlot slot(*server, "slack", spec, 2);
  const unsigned long mine = 200000;  // 200 us, not the default: restored, not reset
  ASSERT_EQ(::prctl(PR_SET_TIMERSLACK, mine, 0, 0, 0), 0);
  EXPECT_THROW(tw::wait_any({slot}, 0.05), tw::Timeout);  // spins out, then naps until the deadline
  EXPECT_EQ(::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), static_cast<int>(mine));
  ASSERT_EQ(::prctl(PR_SET_TIMERSLACK, 0UL, 0, 0, 0), 0);  // 0: back to the thread's default
}

TEST_P(Loopback, WaitAnyFailsWhenTheSenderDies) {
  const tw::TensorSpec spec{{16}, tw::DType{2, 32}};
  tw::StaticSlot slot(*server, "s", spec, 2);
  {
    tw::Channel ch = client->connect(server->address());
    tw::StaticSender sender(ch, "s", kWait);
    sender.send(source.region(), 0, spec, kWait).wait(kWait);
    EXPECT_EQ(tw::wait_any({slot}, kWait), 0u);
    slot.recv(0);
    slot.release();
  }
  client->close();
  // The wait ends with the sender's failure, well before its deadline.
  auto t0 = std::chrono::steady_clock::now();
  try {
    tw::wait_any({slot}, 60.0);
    FAIL() << "wait_any returned for a slot whose sender closed";
  } catch (const tw::Timeout& e) {
    FAIL() << "timed out instead of failing: " << e.what();
  } catch (const tw::Error& e) {
    EXPECT_TRUE(e.kind() == tw::ErrorKind::kPeerFailed || e.kind() == tw::ErrorKind::kConnection)
        << static_cast<int>(e.kind()) << ": " << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST_P(Loopback, ReverseChannel) {
  tw::Channel ch = client->connect(server->address());
  tw::PeerInfo p = server->wait_for_peer(kWait);
  ASSERT_EQ(p.device_id, client->id());
  client->publish("source", source.descriptor());
  // The server writes into the client: now the client is the target.
  Pump client_pump(*client);
  tw::Channel back = server->channel_to(client->id());
  tw::RemoteRegion remote = back.lookup("source", kWait);
  fill_pattern(target.data(), 8192, 44);
  back.write(target.region(), 0, remote, 0, 8192).wait(kWait);
  back.flush().wait(kWait);
  EXPECT_EQ(first_diff(source.data(), target.data(), 8192), -1);
  EXPECT_THROW(server->channel_to(12345), tw::NotFound);
}

TEST_P(Loopback, LaneEndpointOutlivesItsHandles) {
  tw::Channel ch = client->connect(server->address());
  tw::PeerInfo p = server->wait_for_peer(kWait);
  // The channel back: dropping every handle keeps its endpoint, so the next
  // one (a slot made after the last one went) wires nothing up again.
  const tw::detail::ChannelImpl* first = server->channel_to(p.device_id).impl();
  EXPECT_EQ(server->channel_to(p.device_id).impl(), first);
  EXPECT_NE(server->channel_to(p.device_id, 1).impl(), first);
  // A write whose channel handle is dropped while in flight still lands.
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  const tw::detail::ChannelImpl* forward = ch.impl();
  fill_pattern(source.data(), kRegion, 17);
  tw::Request r = ch.write(source.region(), 0, remote, 0, kRegion);
  ch = tw::Channel();
  r.wait(kWait);
  tw::Channel again = client->connect(server->address());
  EXPECT_EQ(again.impl(), forward);
  again.flush().wait(kWait);
  EXPECT_EQ(first_diff(bytes(target), bytes(source), kRegion), -1);
}
TEST_P(Loopback, ClosedDeviceFailsCleanly) {
  tw::Channel ch = client->connect(server->address());
  tw::RemoteRegion remote = ch.lookup("target", kWait);
  client->close();
  EXPECT_TRUE(client->closed());
  EXPECT_THROW(ch.write(source.region(), 0, remote, 0, 64), tw::ConnectionError);
  EXPECT_THROW(ch.lookup("target", kWait), tw::ConnectionError);
  EXPECT_THROW(client->connect(server->address()), tw::ConnectionError);
  // The source block is still usable memory.
  std::memset(source.data(), 1, 64);
}

// Tensors outside the pool (OutsideTensor): the sender copies them into its
// staging block or registers them in place, and counts which.
TEST_P(Loopback, SendersStageOutsideTensors) {
  constexpr std::size_t kN = 1024;
  const tw::TensorSpec spec{{static_cast<std::int64_t>(kN)}, tw::DType{2, 32}};
  tw::StaticSlot slot(*server, "s", spec, 2);
  tw::DynamicSlot dslot(*server, "d");
  tw::Channel ch = client->connect(server->address());
  tw::StaticSender sender(ch, "s", kWait);
  tw::DynamicSender dsender(ch, "d", kWait);
  Pump client_pump(*client);  // inline: the dynamic ack needs the client to progress (rma form over tcp)
  auto tensor = [&](float v) {
    auto t = std::make_shared<std::vector<float>>(kN, v);
    tw::OutsideTensor out;
    out.data = t->data();
    out.keep = t;
    return std::make_pair(t, out);
  };

  // Copy: the bytes are taken at send(); the source may change right after.
  auto [a, outside_a] = tensor(1.5f);
  tw::Request r = sender.send(outside_a, spec, tw::SendPath::kCopy, kWait);
  std::fill(a->begin(), a->end(), -1.0f);
  r.wait(kWait);
  int idx = slot.recv(kWait);
  EXPECT_EQ(static_cast<float*>(slot.buffer(idx))[kN - 1], 1.5f);
  slot.release();

  // Register: `keep` is held until the send completed, dropped by a later call.
  std::weak_ptr<std::vector<float>> held;
  {
    auto [b, outside_b] = tensor(2.5f);
    held = b;
    outside_b.data = b->data();
    r = sender.send(outside_b, spec, tw::SendPath::kRegister, kWait);
  }
  EXPECT_FALSE(held.expired());
  r.wait(kWait);
  idx = slot.recv(kWait);
  EXPECT_EQ(static_cast<float*>(slot.buffer(idx))[0], 2.5f);
  slot.release();
  // A refused tensor (another spec) stages nothing and is not counted; the
  // call still drops what completed sends held.
  auto [c, outside_c] = tensor(3.5f);
  const tw::TensorSpec other{{static_cast<std::int64_t>(kN) / 2}, tw::DType{2, 32}};
  EXPECT_THROW(sender.send(outside_c, other, tw::SendPath::kRegister, kWait), tw::InvalidArgument);
  sender.send(outside_c, spec, tw::SendPath::kCopy, kWait).wait(kWait);
  EXPECT_TRUE(held.expired());
  slot.recv(kWait);
  slot.release();
  auto st = sender.stats();
  EXPECT_EQ(st.copies, 2u);
  EXPECT_EQ(st.registrations, 1u);
  EXPECT_EQ(st.zero_copy, 0u);
  sender.send(source.region(), 0, spec, kWait).wait(kWait);
  EXPECT_EQ(sender.stats().zero_copy, 1u);
  slot.recv(kWait);
  slot.release();

  // Dynamic, copy: the staging block is reused only once the receiver took
  // the previous tensor; until then a send times out and changes nothing.
  auto [d1, outside_d1] = tensor(4.5f);
  tw::Request first = dsender.send(outside_d1, spec, tw::SendPath::kCopy, kWait);
  auto [d2, outside_d2] = tensor(5.5f);
  EXPECT_THROW(dsender.send(outside_d2, spec, tw::SendPath::kCopy, 0.05), tw::Timeout);
  tw::TensorSpec got;
  tw::Block blk = dslot.recv(&got, kWait);
  EXPECT_EQ(static_cast<float*>(blk.data())[kN - 1], 4.5f);
  first.wait(kWait);
  dsender.send(outside_d2, spec, tw::SendPath::kCopy, kWait);
  blk = dslot.recv(&got, kWait);
  EXPECT_EQ(static_cast<float*>(blk.data())[0], 5.5f);
  EXPECT_EQ(dsender.stats().copies, 2u);
  EXPECT_EQ(dsender.stats().sent, 2u);
}

// The shared copy (static_slot.cc, SharedCopy): a receiver waiting in
// recv() copies part of each 1 MiB tensor out of the sender's memory while
// the sender copies the rest. Every byte arrives, tensors alternating between
// two patterns (a chunk of the previous one would show); over the mapped path
// (shm) the two sides shared copies, elsewhere none.
TEST_P(Loopback, SharedCopyMovesEveryByte) {
  const auto& [transport, mode] = GetParam();
  tw::DeviceConfig cfg = make_config(transport, mode);
  cfg.spin_us = 5'000'000;      // the receiver polls throughout (bounded by kWait): it sees every offer
  tw::Device rx(cfg), tx(cfg);  // no Pump: each side's waits drive its own worker
  constexpr std::size_t kN = std::size_t(1) << 20;
  // At least kTensors; over the mapped path more until one was shared (a
  // receiver descheduled meanwhile, as under a parallel ctest, misses an
  // offer, which the sender then copies alone), at most kMaxTensors.
  constexpr int kTensors = 24, kMaxTensors = 2000;
  const tw::TensorSpec spec{{static_cast<std::int64_t>(kN / 4)}, tw::DType{2, 32}};
  tw::StaticSlot slot(rx, "shared", spec, 1);
  tw::Channel ch = tx.connect(rx.address());
  tw::StaticSender sender(ch, "shared", kWait);
  tw::Block src = tx.allocate(kN);
  const bool mapped = ch.impl()->direct_target(sender.region(), src.region()) != nullptr;
  std::vector<unsigned char> patterns[2] = {std::vector<unsigned char>(kN), std::vector<unsigned char>(kN)};
  fill_pattern(patterns[0].data(), kN, 1);
  fill_pattern(patterns[1].data(), kN, 2);
  // Sender and receiver on CPUs of their own where there are two: on one, a
  // spinning receiver runs only between the sender's time slices.
  cpu_set_t allowed, sender_cpu, receiver_cpu;
  CPU_ZERO(&sender_cpu);
  CPU_ZERO(&receiver_cpu);
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  for (int cpu = 0, found = 0; cpu < CPU_SETSIZE && found < 2; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) CPU_SET(cpu, found++ == 0 ? &sender_cpu : &receiver_cpu);
  }
  const bool two_cpus = CPU_COUNT(&receiver_cpu) == 1;
  if (two_cpus) ASSERT_EQ(sched_setaffinity(0, sizeof sender_cpu, &sender_cpu), 0);
  std::atomic<int> total{-1};  // set before the last tensor is sent
  std::string failure;
  std::thread receiver([&] {
    if (two_cpus) sched_setaffinity(0, sizeof receiver_cpu, &receiver_cpu);
    try {
      for (int i = 0; failure.empty() && i != total.load(); ++i) {
        const int idx = slot.recv(kWait);
        if (std::memcmp(slot.buffer(idx), patterns[i % 2].data(), kN) != 0) {
          failure = "tensor " + std::to_string(i) + " differs at byte " +
                    std::to_string(first_diff(slot.buffer(idx), patterns[i % 2].data(), kN));
        }
        slot.release();
      }
    } catch (const tw::Error& e) {
      failure = e.what();
    }
  });
  // Shared only where the slot is mapped at the sender: not over tcp (either
  // form), nor over shm in the message form (inline mode, when the endpoint
  // was not wired up at first use). In polling mode each device's progress
  // thread spins too, and on two CPUs the receiver rarely runs at the time.
  const bool expect_shared = mapped && two_cpus && mode != tw::ProgressMode::kPolling;
  for (int i = 0; i < kMaxTensors; ++i) {
    const bool last = i == kMaxTensors - 1 || (i + 1 >= kTensors && (!expect_shared || sender.stats().shared > 0));
    if (last) total = i + 1;
    std::memcpy(src.data(), patterns[i % 2].data(), kN);
    sender.send(src.region(), 0, spec, kWait).wait(kWait);
    sender.wait_consumed(sender.last_sent(), kWait);  // so the receiver waits for the next one
    if (last) break;
  }
  receiver.join();
  sched_setaffinity(0, sizeof allowed, &allowed);
  EXPECT_EQ(failure, "");
  EXPECT_EQ(sender.stats().shared, slot.stats().shared);
  if (!mapped) {
    EXPECT_EQ(slot.stats().shared, 0u);
  } else if (expect_shared) {
    EXPECT_GT(slot.stats().shared, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, Loopback,
                         ::testing::Combine(::testing::Values(std::string("tcp"), std::string("shm")),
                                            ::testing::Values(tw::ProgressMode::kBlocking, tw::ProgressMode::kPolling,
                                                              tw::ProgressMode::kInline)),
                         param_name);

// ---- refused connections ----

class Refusal : public ::testing::TestWithParam<tw::ProgressMode> {
 protected:
  void SetUp() override { ASSERT_TRUE(kEnvReady); }
  tw::DeviceConfig config() const { return make_config("tcp", GetParam()); }
};

TEST_P(Refusal, NobodyListening) {
  // A socket bound to a port but not listening: connections to it are refused,
  // and nobody else can take the port while we hold it.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));

  tw::DeviceConfig c = config();
  c.connect_timeout_s = 3.0;
  tw::Device client(c);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(client.connect(address), tw::ConnectionError);
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(elapsed, 6.0);
  EXPECT_TRUE(client.peers().empty());
  // The device is still usable: it can connect somewhere real afterwards.
  tw::Device server(config());
  tw::Channel ch = client.connect(server.address());
  EXPECT_EQ(ch.peer().device_id, server.id());
  ::close(fd);
}

TEST_P(Refusal, RepeatedRefusedConnects) {
  // Regression: UCX could apply the refusal between creating the endpoint and
  // sending HELLO, and then spin forever in the send (about 1 connect in 5).
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  tw::DeviceConfig c = config();
  c.connect_timeout_s = 3.0;
  tw::Device client(c);
  for (int i = 0; i < 25; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_THROW(client.connect(address), tw::ConnectionError) << "attempt " << i;
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_LT(elapsed, 6.0) << "attempt " << i;
  }
  ::close(fd);
}

TEST_P(Refusal, BadAddress) {
  tw::Device client(config());
  EXPECT_THROW(client.connect("no-port"), tw::InvalidArgument);
  EXPECT_THROW(client.connect("127.0.0.1:0"), tw::InvalidArgument);
  EXPECT_THROW(client.connect("127.0.0.1:99999"), tw::InvalidArgument);
  EXPECT_THROW(client.connect("127.0.0.1:12ab"), tw::InvalidArgument);
}

TEST_P(Refusal, TokenMismatch) {
  tw::DeviceConfig sc = config();
  sc.token = "right-token";
  tw::Device server(sc);
  tw::DeviceConfig cc = config();
  cc.token = "wrong-token";
  tw::Device client(cc);
  EXPECT_THROW(client.connect(server.address()), tw::ConnectionError);
  EXPECT_EQ(server.refusals(), 1u);
  EXPECT_TRUE(server.peers().empty());
  EXPECT_TRUE(client.peers().empty());
  // No token at all is a mismatch too.
  tw::Device anonymous(config());
  EXPECT_THROW(anonymous.connect(server.address()), tw::ConnectionError);
  EXPECT_EQ(server.refusals(), 2u);
  // The right token gets in.
  cc.token = "right-token";
  tw::Device friendly(cc);
  tw::Channel ch = friendly.connect(server.address());
  EXPECT_EQ(ch.peer().device_id, server.id());
  EXPECT_EQ(server.refusals(), 2u);
  EXPECT_EQ(server.wait_for_peer(kWait).device_id, friendly.id());
}

TEST_P(Refusal, ProtocolVersionMismatch) {
  tw::Device server(config());
  tw::DeviceConfig cc = config();
  cc.protocol_version = static_cast<std::uint16_t>(tw::protocol_version() + 1);
  tw::Device client(cc);
  EXPECT_THROW(client.connect(server.address()), tw::ProtocolMismatch);
  EXPECT_EQ(server.refusals(), 1u);
  EXPECT_TRUE(server.peers().empty());
  // And the other way round: a server speaking another version refuses us.
  tw::DeviceConfig sc = config();
  sc.protocol_version = static_cast<std::uint16_t>(tw::protocol_version() + 7);
  tw::Device odd_server(sc);
  tw::Device plain(config());
  EXPECT_THROW(plain.connect(odd_server.address()), tw::ProtocolMismatch);
  EXPECT_EQ(odd_server.refusals(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Modes, Refusal,
                         ::testing::Values(tw::ProgressMode::kBlocking, tw::ProgressMode::kPolling,
                                           tw::ProgressMode::kInline),
                         [](const ::testing::TestParamInfo<tw::ProgressMode>& info) {
                           return std::string(mode_name(info.param));
                         });
