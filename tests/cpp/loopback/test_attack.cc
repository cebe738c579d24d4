// Copyright tensorwire authors.
//
// A modified peer (docs/contracts.md §11): it holds a valid token and
// connects as an ordinary device, then skips its own device's checks. Over
// tcp it takes what the internal headers give it (the lane's socket, raw
// frames with any header; a UCX endpoint of its own to the victim's worker)
// and aims at memory the victim never exported to it: a pool neighbour of the
// published block, a dedicated slab, a registered array, the heap, the byte
// after the published block, an unmapped address. The victim's bytes must
// not change, the victim must stay alive, and every attempt must be refused.
// Over shared memory the same test documents what a same-host peer reaches.
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/control_wire.h"
#include "core/device_impl.h"
#include "core/messages.h"
#include "net/socket.h"
#include "tensorwire/channel.h"
#include "tensorwire/device.h"
#include "tensorwire/error.h"
#include "tensorwire/memory.h"
#include "tensorwire/slot.h"

namespace tw = tensorwire;
namespace td = tensorwire::detail;

namespace {

constexpr double kWait = 10.0;

tw::DeviceConfig config(const std::string& transport) {
  tw::DeviceConfig c;
  c.host = "127.0.0.1";
  c.net_devices = "lo";
  c.transport = transport;
  c.slab_size = std::size_t(8) << 20;
  c.connect_timeout_s = 5.0;
  return c;
}

// A target of the attack: its bytes, and a copy to compare with.
struct Secret {
  std::string what;
  unsigned char* at;
  std::size_t n;
  std::vector<unsigned char> was;
  Secret(std::string w, void* p, std::size_t len) : what(std::move(w)), at(static_cast<unsigned char*>(p)), n(len) {
    for (std::size_t i = 0; i < n; ++i) at[i] = static_cast<unsigned char>(i * 7 + 3);
    was.assign(at, at + n);
  }
  bool intact() const { return std::memcmp(at, was.data(), n) == 0; }
};

tw::RemoteRegion forged(const tw::RemoteRegion& real, std::uint64_t address, std::uint64_t length) {
  tw::RegionDescriptor d = real.descriptor();
  d.address = address;
  d.length = length;
  return tw::RemoteRegion(std::make_shared<td::RemoteRegionImpl>(std::move(d)));
}

// Waits (bounded) until the victim counted `n` more refused data messages.
void await_refusals(tw::Device& victim, std::uint64_t before, std::uint64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (victim.impl()->message_refusals() < before + n && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

TEST(ModifiedPeer, OverTcpReachesOnlyWhatWasExported) {
  tw::Device victim(config("tcp"));
  tw::Device attacker(config("tcp"));
  tw::Block published = victim.allocate(4096);
  tw::Block neighbour = victim.allocate(4096);                  // same slab, never exported
  tw::Block dedicated = victim.allocate(std::size_t(4) << 20);  // a slab of its own
  std::vector<unsigned char> array(65536), heap(65536);
  tw::Registration registered = victim.pool().register_memory(array.data(), array.size());
  victim.publish("pub", published.descriptor());
  std::vector<Secret> secrets;
  secrets.emplace_back("the pool neighbour", neighbour.data(), 4096);
  secrets.emplace_back("a dedicated slab", dedicated.data(), 4096);
  secrets.emplace_back("a registered array", array.data(), array.size());
  secrets.emplace_back("the heap", heap.data(), heap.size());
  void* unmapped = ::mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(unmapped, MAP_FAILED);
  ::munmap(unmapped, 4096);  // an address nothing maps

  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);
  // The lane is tensorwire's socket: no UCX endpoint reaches the victim at all.
  ASSERT_EQ(ch.impl()->lane().kind(), td::LaneKind::kSocket);
  EXPECT_EQ(ch.transports(), std::vector<std::string>{"tcp/lo"});  // a socket bound to net_devices

  tw::Block src = attacker.allocate(65536);
  std::memset(src.data(), 0xee, 65536);
  tw::Block dst = attacker.allocate(65536);
  const std::uint64_t after_pub = reinterpret_cast<std::uint64_t>(published.data()) + 4096;
  struct Aim {
    std::string what;
    std::uint64_t address;
    std::uint64_t length;
  };
  std::vector<Aim> aims;
  for (const Secret& s : secrets) aims.push_back({s.what, reinterpret_cast<std::uint64_t>(s.at), 64});
  aims.push_back({"the byte after the published block", after_pub - 63, 64});
  aims.push_back({"an unmapped address", reinterpret_cast<std::uint64_t>(unmapped), 64});
  aims.push_back({"address 0", 0, 64});
  aims.push_back({"the top of the address space", ~std::uint64_t(0) - 7, 64});  // wraps: must not pass a check

  // 1. Through its own channel, with forged descriptors (the initiator's checks skipped).
  const auto refused_before = victim.impl()->message_refusals();
  std::uint64_t attempts = 0;
  for (const Aim& a : aims) {
    tw::RemoteRegion r = forged(pub, a.address, a.length);
    EXPECT_THROW(ch.write(src.region(), 0, r, 0, a.length).wait(kWait), tw::InvalidArgument) << a.what;
    EXPECT_THROW(ch.read(dst.region(), 0, r, 0, a.length).wait(kWait), tw::InvalidArgument) << a.what;
    attempts += 2;
  }
  // 2. Raw frames on the lane's socket: a put, a flagged put (flag outside)
  // and a get, with any op id, straight past the channel.
  for (const Aim& a : aims) {
    td::DataHeader h;
    h.token = ch.impl()->peer->hello.data_token;
    h.target = 999999;  // no op of ours: the victim's answer is refused here
    h.kind = td::MsgKind::kPut;
    h.a = a.address;
    ch.impl()->lane().send(h.encode(), src.data(), a.length, nullptr, nullptr);
    h.kind = td::MsgKind::kPutFlagged;
    h.a = reinterpret_cast<std::uint64_t>(published.data());  // inside the export...
    h.b = (a.address + a.length) & ~std::uint64_t(7);         // ...its flag outside (past the aim)
    td::ByteWriter flag;
    flag.put<std::uint64_t>(0xdeadbeef);
    ch.impl()->lane().send(h.encode(flag.str()), src.data(), 8, nullptr, nullptr);
    h.kind = td::MsgKind::kGet;
    h.a = a.address;
    h.b = a.length;
    ch.impl()->lane().send(h.encode(), nullptr, 0, nullptr, nullptr);
    attempts += 3;
  }
  // A large put (streamed, not eager) at the neighbour, and one whose length runs past the export.
  {
    td::DataHeader h;
    h.token = ch.impl()->peer->hello.data_token;
    h.kind = td::MsgKind::kPut;
    h.target = 999999;
    h.a = reinterpret_cast<std::uint64_t>(neighbour.data());
    ch.impl()->lane().send(h.encode(), src.data(), 65536, nullptr, nullptr);
    h.a = reinterpret_cast<std::uint64_t>(published.data());
    ch.impl()->lane().send(h.encode(), src.data(), 65536, nullptr, nullptr);
    attempts += 2;
  }
  await_refusals(victim, refused_before, attempts);
  EXPECT_GE(victim.impl()->message_refusals(), refused_before + attempts);
  for (const Secret& s : secrets) EXPECT_TRUE(s.intact()) << s.what << " changed";

  // 3. A UCX endpoint of its own (UCX's tcp, RMA on) to the victim's data
  // worker: the victim's worker offers no transport a network peer reaches.
  {
    auto context = std::make_shared<tw::ucx::Context>(
        std::vector<std::pair<std::string, std::string>>{{"TLS", "tcp"}, {"NET_DEVICES", "lo"}},
        UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        "attacker");  // WAKEUP: ucx::Worker asks for the event fd
    auto worker = std::make_shared<tw::ucx::Worker>(context);
    const std::string& victim_worker = ch.impl()->peer->hello.workers.at(0);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = reinterpret_cast<const ucp_address_t*>(victim_worker.data());
    ucp_ep_h ep = nullptr;
    EXPECT_EQ(ucp_ep_create(worker->get(), &params, &ep), UCS_ERR_UNREACHABLE)
        << "a raw UCX endpoint reached the victim's data worker";
  }
  // 4. Bytes that are not tensorwire's (UCX's own connection request, say) on
  // the victim's port: it closes that connection and carries on.
  {
    auto [host, port] = tw::net::split_address(victim.address());
    socklen_t len = 0;
    const sockaddr_storage ss = tw::net::resolve(host, port, &len);
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&ss), len), 0);
    const char junk[] = "not a tensorwire frame, and long enough for a prefix";
    ASSERT_GT(::send(fd, junk, sizeof(junk), MSG_NOSIGNAL), 0);
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char c;
    EXPECT_EQ(::recv(fd, &c, 1, 0), 0) << "the victim kept a connection that spoke garbage";
    ::close(fd);
  }
  for (const Secret& s : secrets) EXPECT_TRUE(s.intact()) << s.what << " changed";

  // The victim is alive and still serves what it did export.
  std::memset(src.data(), 0x42, 4096);
  ch.write(src.region(), 0, pub, 0, 4096).wait(kWait);
  EXPECT_EQ(static_cast<unsigned char*>(published.data())[4095], 0x42);
  tw::Device bystander(config("tcp"));
  EXPECT_NO_THROW(bystander.connect(victim.address()).lookup("pub", kWait));
}

namespace {

int raw_connect(const std::string& address) {
  auto [host, port] = tw::net::split_address(address);
  socklen_t len = 0;
  const sockaddr_storage ss = tw::net::resolve(host, port, &len);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&ss), len) != 0) return -1;
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

bool send_all(int fd, const std::string& bytes) {
  return ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

}  // namespace

// Frames that lie about their sizes, written raw (past the sender's own
// checks): a payload that claims far more than the export, and a header
// past the limit. Neither lands a byte; the second ends its connection; the
// victim carries on.
TEST(ModifiedPeer, OverTcpLyingFramesLandNothing) {
  tw::Device victim(config("tcp"));
  tw::Device attacker(config("tcp"));
  tw::Block published = victim.allocate(4096);
  victim.publish("pub", published.descriptor());
  Secret secret("the published block", published.data(), 4096);
  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);

  // A lane of its own, introduced with the attacker's valid token.
  int lane = raw_connect(victim.address());
  ASSERT_GE(lane, 0);
  td::LaneIntro intro;
  intro.version = tw::protocol_version();
  intro.token = ch.impl()->peer->hello.data_token;
  ASSERT_TRUE(send_all(lane, tw::net::encode_prefix(td::LaneIntro::kSize, 0) + intro.encode()));
  // A put into the published block whose payload claims 1 TiB: refused by the
  // victim's range check before a byte lands, and the bytes that follow are dropped.
  td::DataHeader h;
  h.kind = td::MsgKind::kPut;
  h.token = intro.token;
  h.target = 1;
  h.a = pub.descriptor().address;
  const std::string header = h.encode();
  const auto before = victim.impl()->message_refusals();
  ASSERT_TRUE(send_all(
      lane, tw::net::encode_prefix(header.size(), tw::net::kMaxPayload) + header + std::string(65536, '\xee')));
  await_refusals(victim, before, 1);
  EXPECT_EQ(victim.impl()->message_refusals(), before + 1);
  EXPECT_TRUE(secret.intact());
  ::close(lane);

  // A first frame whose prefix claims a 2 GiB header: the victim closes the connection.
  int liar = raw_connect(victim.address());
  ASSERT_GE(liar, 0);
  std::string lie = tw::net::encode_prefix(0, 0);
  lie[7] = static_cast<char>(0x80);  // header length 0x80000000
  ASSERT_TRUE(send_all(liar, lie));
  char c;
  EXPECT_EQ(::recv(liar, &c, 1, 0), 0) << "the victim kept a connection whose frame lied";
  ::close(liar);
  EXPECT_TRUE(secret.intact());
  tw::Device bystander(config("tcp"));
  EXPECT_NO_THROW(bystander.connect(victim.address()).lookup("pub", kWait));
}

// A lane read after its peer left (dialled just before the peer closed, read
// after its control connection ended) is closed and not counted as refused: a
// server's refusals count the peers it turned away, not the ones that left.
// A token that never named a peer is still refused.
TEST(ModifiedPeer, ALaneOfAPeerThatLeftIsClosedNotRefused) {
  tw::Device victim(config("tcp"));
  std::uint64_t token = 0;
  {
    tw::Device leaver(config("tcp"));
    tw::Channel ch = leaver.connect(victim.address());
    token = ch.impl()->peer->hello.data_token;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!victim.peers().empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(victim.peers().empty());
  const auto before = victim.refusals();
  auto lane_with = [&](std::uint64_t t) {
    int fd = raw_connect(victim.address());
    td::LaneIntro intro;
    intro.version = tw::protocol_version();
    intro.token = t;
    EXPECT_TRUE(send_all(fd, tw::net::encode_prefix(td::LaneIntro::kSize, 0) + intro.encode()));
    char c;
    EXPECT_EQ(::recv(fd, &c, 1, 0), 0) << "the victim kept a lane with token " << t;
    ::close(fd);
  };
  lane_with(token);
  EXPECT_EQ(victim.refusals(), before);
  lane_with(token ^ 0x5a5a5a5a5a5a5a5aULL);
  EXPECT_EQ(victim.refusals(), before + 1);
}

// Over shared memory a same-host peer maps the slab of a key it was handed
// (its direct path, and UCX's posix/sysv transports do the same): it reaches
// the published block's pool neighbours through it. The slab is all it maps;
// same-user processes reach each other's memory through the kernel anyway
// (process_vm_writev, ptrace): docs/contracts.md §11.
TEST(ModifiedPeer, OverSharedMemoryAPeerReachesTheSlabItWasHandedAKeyFor) {
  tw::Device victim(config("shm"));
  tw::Device attacker(config("shm"));
  tw::Block published = victim.allocate(4096);
  tw::Block neighbour = victim.allocate(4096);
  victim.publish("pub", published.descriptor());
  Secret secret("the pool neighbour", neighbour.data(), 4096);
  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);
  ASSERT_EQ(ch.impl()->lane().kind(), td::LaneKind::kUcx);
  const td::RemoteRegionImpl::Access access = ch.impl()->lane().access(pub);
  ASSERT_NE(access.mapped, nullptr) << "shared memory maps the published block's slab";
  const std::ptrdiff_t to_neighbour = static_cast<char*>(neighbour.data()) - static_cast<char*>(published.data());
  access.mapped[to_neighbour] = 0x77;  // what a modified peer does with the mapping
  EXPECT_FALSE(secret.intact()) << "a same-host peer reaches the slab of a key it holds";
}

// The shared copy (contracts §10.3, static_slot.cc): a static slot's
// receiver copies out of its sender's memory only what that sender exported
// to it. A modified sender that offers another block of its own pool (the
// same slab key, never exported) gets nothing copied; the same offer once
// the block is exported is copied, so the export check is what refused it.
TEST(ModifiedPeer, OverSharedMemoryAnOfferReadsOnlyExportedMemory) {
  tw::Device victim(config("shm"));
  tw::Device attacker(config("shm"));
  constexpr std::size_t kN = std::size_t(1) << 20;
  const tw::TensorSpec spec{{static_cast<std::int64_t>(kN / 4)}, tw::DType{2, 32}};
  tw::Channel ch = attacker.connect(victim.address());
  tw::Block block = attacker.allocate(kN);
  Secret secret("a block of the sender's pool", block.data(), kN);
  const std::string key = block.descriptor().rkey;
  // Offers `block` as tensor 1 in the help area of the slot `sender` is attached to.
  auto offer = [&](tw::StaticSender& sender) {
    char* slot = ch.impl()->lane().access(sender.region()).mapped;
    ASSERT_NE(slot, nullptr);
    char* area = slot + (kN + 64);  // after one buffer of align64(kN) + its 64-byte tail
    const std::uint64_t address = reinterpret_cast<std::uint64_t>(block.data());
    const auto length = static_cast<std::uint32_t>(key.size());
    std::memcpy(area + 64, &address, 8);
    std::memcpy(area + 72, &length, 4);
    std::memcpy(area + 76, key.data(), key.size());
    std::uint64_t tag = std::uint64_t(1) << 24;  // sequence 1, no chunk taken
    std::memcpy(area + 8, &tag, 8);
    std::atomic_thread_fence(std::memory_order_release);
    std::memcpy(area, &tag, 8);
  };
  auto zero = [](const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    return std::all_of(c, c + n, [](unsigned char v) { return v == 0; });
  };
  {
    tw::StaticSlot slot(victim, "unexported", spec, 1);
    tw::StaticSender sender(ch, "unexported", kWait);
    offer(sender);
    EXPECT_THROW(slot.recv(0.2), tw::Timeout);  // no sequence word: no tensor
    EXPECT_TRUE(zero(slot.buffer(0), kN)) << "the receiver copied memory that was never exported to it";
    EXPECT_EQ(slot.stats().shared, 0u);
  }
  {
    tw::StaticSlot slot(victim, "exported", spec, 1);
    tw::StaticSender sender(ch, "exported", kWait);
    ch.export_region(block.region(), kWait);
    offer(sender);
    EXPECT_THROW(slot.recv(0.2), tw::Timeout);
    EXPECT_EQ(std::memcmp(slot.buffer(0), secret.was.data(), kN), 0) << "an exported block's offer is copied";
    EXPECT_EQ(slot.stats().shared, 1u);
  }
}

// The same offer over tcp, written into the slot's help area by a message-form
// write (the block is exported to the sender, so the target lands it), of a
// block the sender did export: a tcp lane maps nothing, so the receiver copies
// nothing and stays alive (its lane back has no UCX endpoint to unpack a key on).
TEST(ModifiedPeer, OverTcpAnOfferMapsNothing) {
  tw::Device victim(config("tcp"));
  tw::Device attacker(config("tcp"));
  constexpr std::size_t kN = std::size_t(1) << 20;
  const tw::TensorSpec spec{{static_cast<std::int64_t>(kN / 4)}, tw::DType{2, 32}};
  tw::Channel ch = attacker.connect(victim.address());
  tw::Block block = attacker.allocate(kN);
  Secret secret("a block the sender exported", block.data(), kN);
  ch.export_region(block.region(), kWait);
  tw::StaticSlot slot(victim, "offered", spec, 1);
  tw::StaticSender sender(ch, "offered", kWait);
  const std::string key = block.descriptor().rkey;
  tw::Block offer = attacker.allocate(4096);
  char* area = static_cast<char*>(offer.data());
  std::memset(area, 0, 4096);
  const std::uint64_t done = std::uint64_t(1) << 24, address = reinterpret_cast<std::uint64_t>(block.data());
  const auto length = static_cast<std::uint32_t>(key.size());
  std::memcpy(area, &done, 8);  // claim: sequence 1, no chunk taken
  std::memcpy(area + 8, &done, 8);
  std::memcpy(area + 64, &address, 8);
  std::memcpy(area + 72, &length, 4);
  std::memcpy(area + 76, key.data(), key.size());
  ch.write(offer.region(), 0, sender.region(), kN + 64, 76 + key.size()).wait(kWait);
  EXPECT_THROW(slot.recv(0.3), tw::Timeout);
  EXPECT_EQ(slot.stats().shared, 0u);
  const auto* c = static_cast<const unsigned char*>(slot.buffer(0));
  EXPECT_TRUE(std::all_of(c, c + kN, [](unsigned char v) { return v == 0; }));
}

// ---- No data op outlives its grant (issue 49 item 1) ----

namespace {

// A lane of the attacker's own on the victim, introduced with its valid token.
int raw_lane(const tw::Channel& ch, const std::string& victim_address) {
  int fd = raw_connect(victim_address);
  if (fd < 0) return -1;
  td::LaneIntro intro;
  intro.version = tw::protocol_version();
  intro.token = ch.impl()->peer->hello.data_token;
  if (!send_all(fd, tw::net::encode_prefix(td::LaneIntro::kSize, 0) + intro.encode())) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool recv_all(int fd, char* p, std::size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

// One frame from a raw socket (its SO_RCVTIMEO bounds the wait): false when none came.
bool recv_frame(int fd, td::DataHeader* h, std::string* payload) {
  char prefix[tw::net::kPrefixSize];
  if (!recv_all(fd, prefix, sizeof(prefix))) return false;
  tw::net::Prefix p;
  if (!tw::net::decode_prefix(prefix, &p).empty()) return false;
  std::string header(p.header_length, '\0');
  payload->assign(p.payload_length, '\0');
  if (!recv_all(fd, header.data(), header.size()) || !recv_all(fd, payload->data(), payload->size())) return false;
  td::ByteReader r(header.data(), header.size(), "reply");
  *h = td::DataHeader::decode(r);
  return true;
}

std::string put_frame(const tw::Channel& ch, std::uint64_t address, std::uint64_t length) {
  td::DataHeader h;
  h.kind = td::MsgKind::kPut;
  h.token = ch.impl()->peer->hello.data_token;
  h.target = 1;
  h.a = address;
  const std::string header = h.encode();
  return tw::net::encode_prefix(header.size(), length) + header;
}

bool wait_until(const std::function<bool()>& ready, double seconds = kWait) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

// A put whose header and first part arrive, then the block is freed and
// leased again, then the rest arrives: the rest lands nowhere (the victim's
// socket discards it), the put is answered "failed", and the block's next
// owner keeps its bytes.
TEST(ModifiedPeer, OverTcpAPutLandingAcrossAFreeMissesTheNextOwner) {
  tw::Device victim(config("tcp"));
  tw::Device attacker(config("tcp"));
  constexpr std::size_t kN = std::size_t(256) << 10;  // streamed (past the eager size)
  constexpr std::size_t kFirst = std::size_t(96) << 10;
  auto published = std::make_unique<tw::Block>(victim.allocate(kN));
  std::memset(published->data(), 0, kN);
  auto* const at = static_cast<unsigned char*>(published->data());
  victim.publish("pub", published->descriptor());
  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);
  int lane = raw_lane(ch, victim.address());
  ASSERT_GE(lane, 0);

  ASSERT_TRUE(send_all(lane, put_frame(ch, pub.descriptor().address, kN) + std::string(kFirst, '\xee')));
  ASSERT_TRUE(wait_until([&] { return at[kFirst - 1] == 0xee; })) << "the first part never landed";
  victim.unpublish("pub");
  published.reset();  // the pool's free: the grant ends
  tw::Block next = victim.allocate(kN);
  ASSERT_EQ(next.data(), at) << "the pool leased other bytes: the test proves nothing";
  Secret owner("the block's next owner", next.data(), kN);
  ASSERT_TRUE(send_all(lane, std::string(kN - kFirst, '\xee')));

  td::DataHeader reply;
  std::string payload;
  ASSERT_TRUE(recv_frame(lane, &reply, &payload)) << "the put was not answered";
  EXPECT_EQ(reply.kind, td::MsgKind::kPutDone);
  EXPECT_EQ(reply.b, static_cast<std::uint64_t>(td::AccessStatus::kFailed));
  EXPECT_TRUE(owner.intact()) << "the rest of a put landed in memory leased again";
  EXPECT_EQ(victim.impl()->live_landings(), 0u);
  // The victim carries on: a fresh export is served (before the lane closes:
  // a lane's end is its peer's).
  victim.publish("next", next.descriptor());
  tw::RemoteRegion r = ch.lookup("next", kWait);
  tw::Block src = attacker.allocate(kN);
  std::memset(src.data(), 0x42, kN);
  ch.write(src.region(), 0, r, 0, kN).wait(kWait);
  EXPECT_EQ(at[kN - 1], 0x42);
  ::close(lane);
}

// 8,000 gets of a 4 KiB block whose replies the peer does not read, the
// block freed and leased again, then every reply read: none carries the next
// owner's bytes (a queued reply's payload was copied at the free).
TEST(ModifiedPeer, OverTcpUnreadGetsAcrossAFreeCarryNoneOfTheNextOwner) {
  tw::Device victim(config("tcp"));
  tw::Device attacker(config("tcp"));
  constexpr std::size_t kN = 4096;
  constexpr int kGets = 8000;
  auto published = std::make_unique<tw::Block>(victim.allocate(kN));
  std::memset(published->data(), 0x11, kN);
  void* const at = published->data();
  victim.publish("pub", published->descriptor());
  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);
  int lane = raw_lane(ch, victim.address());
  ASSERT_GE(lane, 0);

  std::string gets;
  for (int i = 0; i < kGets; ++i) {
    td::DataHeader h;
    h.kind = td::MsgKind::kGet;
    h.token = ch.impl()->peer->hello.data_token;
    h.target = static_cast<std::uint64_t>(i) + 1;
    h.a = pub.descriptor().address;
    h.b = kN;
    const std::string header = h.encode();
    gets += tw::net::encode_prefix(header.size(), 0) + header;
  }
  timeval tv{10, 0};
  setsockopt(lane, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  // A thread sends them: a victim that stops reading while its replies are unread may leave this send waiting.
  std::thread sender([&] { send_all(lane, gets); });
  // Replies pile up unread (the sockets' buffers hold a few MiB of the 32).
  EXPECT_TRUE(wait_until([&] { return victim.impl()->live_landings() > 0; })) << "no reply was ever queued";
  victim.unpublish("pub");
  published.reset();
  tw::Block next = victim.allocate(kN);
  ASSERT_EQ(next.data(), at) << "the pool leased other bytes: the test proves nothing";
  Secret owner("the block's next owner", next.data(), kN);

  int ok = 0, refused = 0, leaked = 0;
  for (int i = 0; i < kGets; ++i) {
    td::DataHeader reply;
    std::string payload;
    if (!recv_frame(lane, &reply, &payload)) break;
    ASSERT_EQ(reply.kind, td::MsgKind::kGetData);
    if (reply.b != static_cast<std::uint64_t>(td::AccessStatus::kOk)) {
      ++refused;
      continue;
    }
    ++ok;
    ASSERT_EQ(payload.size(), kN);
    if (payload != std::string(kN, '\x11')) ++leaked;
  }
  sender.join();
  ::close(lane);
  EXPECT_EQ(ok + refused, kGets);
  EXPECT_GT(ok, 0);
  EXPECT_EQ(leaked, 0) << leaked << " replies carried bytes other than the freed block's";
  EXPECT_TRUE(owner.intact());
}

// ---- Nothing leaks per connection (issue 49 item 5) ----

namespace {

std::size_t count_entries(const char* dir) {
  std::size_t n = 0;
  if (DIR* d = ::opendir(dir)) {
    while (::readdir(d)) ++n;
    ::closedir(d);
  }
  return n;
}

std::size_t resident_kib() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  std::size_t kib = 0;
  while (std::fgets(line, sizeof(line), f)) {
    if (std::sscanf(line, "VmRSS: %zu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib;
}

// One short-lived peer on a connected socket: HELLO (as a device of its own), the reply, close.
bool hello_on(int fd, std::uint64_t device_id) {
  tw::control::Hello hello;
  hello.device_id = device_id;
  hello.pid = 1;
  hello.hostname = "short-lived";
  hello.address = "127.0.0.1:1";
  hello.data_token = device_id;
  hello.workers = {"a worker address nobody reaches"};
  tw::control::Header h;
  h.type = tw::control::MsgType::kHello;
  h.request_id = 1;
  const std::string msg = tw::control::encode(h, tw::control::encode_hello(hello));
  bool ok = send_all(fd, tw::net::encode_prefix(msg.size(), 0) + msg);
  char prefix[tw::net::kPrefixSize];
  tw::net::Prefix p;
  ok = ok && recv_all(fd, prefix, sizeof(prefix)) && tw::net::decode_prefix(prefix, &p).empty();
  std::string reply(p.header_length, '\0');
  ok = ok && recv_all(fd, reply.data(), reply.size());
  if (ok) {
    td::ByteReader r(reply.data(), reply.size(), "HELLO reply");
    const tw::control::Header rh = tw::control::decode_header(r);
    ok = rh.type == tw::control::MsgType::kHelloReply && rh.status == tw::control::Status::kOk;
    if (!ok) std::fprintf(stderr, "HELLO refused: %s\n", r.get_n(r.left()).c_str());
  }
  ::close(fd);
  return ok;
}

bool hello_and_close(const std::string& address, std::uint64_t device_id) {
  int fd = raw_connect(address);
  return fd >= 0 && hello_on(fd, device_id);
}

}  // namespace

// Run by ConnectionsLeakNothing in a process of its own (TW_LEAK_CHILD=1),
// whose descriptor limit it lowers: a server must live through more short
// connections than the limit, with descriptors, threads and memory flat.
TEST(ShortConnections, Child) {
  if (!std::getenv("TW_LEAK_CHILD")) GTEST_SKIP() << "run by ShortConnections.LeakNothing";
  tw::Device server(config("tcp"));
  const std::size_t base_fds = count_entries("/proc/self/fd");
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  lim.rlim_cur = base_fds + 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  constexpr int kWarm = 100, kCycles = 2000;
  std::size_t fds = 0, threads = 0, rss = 0;
  for (int i = 0; i < kWarm + kCycles; ++i) {
    ASSERT_TRUE(hello_and_close(server.address(), 0x1000 + static_cast<std::uint64_t>(i)))
        << "connection " << i << " failed (descriptor limit " << lim.rlim_cur << ")";
    if (i == kWarm - 1) {
      // The server sees each close a moment later.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      fds = count_entries("/proc/self/fd");
      threads = count_entries("/proc/self/task");
      rss = resident_kib();
    }
  }
  ASSERT_TRUE(wait_until([&] { return count_entries("/proc/self/fd") <= fds + 2; }))
      << count_entries("/proc/self/fd") - fds << " more descriptors after " << kCycles << " connections";
  EXPECT_LE(count_entries("/proc/self/task"), threads);
  EXPECT_TRUE(wait_until([&] { return server.peers().empty(); })) << "the last peers' closes were never seen";
  const std::size_t grown = resident_kib() - std::min(rss, resident_kib());
  EXPECT_LT(grown, std::size_t(8) << 10) << grown << " KiB more after " << kCycles << " connections";
  // Out of descriptors: a connection waits (the listener rests instead of
  // spinning), and is served once descriptors are back.
  {
    std::vector<int> filler;
    for (int f; (f = ::dup(0)) >= 0;) filler.push_back(f);
    ::close(filler.back());  // one for the client's socket: none for the server's accept
    filler.pop_back();
    int fd = raw_connect(server.address());
    ASSERT_GE(fd, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server fails to accept meanwhile
    for (int f : filler) ::close(f);
    EXPECT_TRUE(hello_on(fd, 0x900000)) << "a connection made while the server had no descriptor left";
  }
  // Devices of their own, with a data lane each (the server accepts it on a worker), dropped.
  tw::Block block = server.allocate(4096);
  server.publish("pub", block.descriptor());
  for (int i = 0; i < 30; ++i) {  // ~0.1 s each
    tw::Device client(config("tcp"));
    tw::Channel ch = client.connect(server.address());
    tw::Block src = client.allocate(4096);
    ch.write(src.region(), 0, ch.lookup("pub", kWait), 0, 4096).wait(kWait);
  }
  ASSERT_TRUE(wait_until([&] { return count_entries("/proc/self/fd") <= fds + 2; }))
      << count_entries("/proc/self/fd") - fds << " more descriptors after 30 devices came and went";
  EXPECT_TRUE(wait_until([&] { return server.peers().empty(); })) << server.peers().size() << " peers left";
  EXPECT_LE(count_entries("/proc/self/task"), threads);
}

TEST(ShortConnections, LeakNothing) {
  // A process of its own: the lowered limit, and a count of its descriptors, are its alone.
  std::string self(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  ASSERT_GT(n, 0);
  self.resize(static_cast<std::size_t>(n));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setenv("TW_LEAK_CHILD", "1", 1);
    ::unsetenv("GTEST_TOTAL_SHARDS");
    ::unsetenv("GTEST_SHARD_INDEX");
    ::execl(self.c_str(), self.c_str(), "--gtest_filter=ShortConnections.Child", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  pid_t done = 0;
  while ((done = ::waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (done == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the child did not finish within 120 s";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "ShortConnections.Child failed (its output is above)";
}

// ---- Replies bound to their connection; claimed identities (issue 49 items 2-3) ----

namespace {

// A raw control connection that said HELLO as device `device_id` (status of the reply in *status).
int raw_hello(const std::string& address, std::uint64_t device_id, tw::control::Status* status,
              std::string* body = nullptr) {
  int fd = raw_connect(address);
  if (fd < 0) return -1;
  tw::control::Hello hello;
  hello.device_id = device_id;
  hello.pid = 1;
  hello.hostname = "attacker";
  hello.address = "127.0.0.1:1";
  hello.data_token = 0x5eed;
  hello.workers = {"a worker address nobody reaches"};
  tw::control::Header h;
  h.type = tw::control::MsgType::kHello;
  h.request_id = 1;
  const std::string msg = tw::control::encode(h, tw::control::encode_hello(hello));
  char prefix[tw::net::kPrefixSize];
  tw::net::Prefix p;
  if (!send_all(fd, tw::net::encode_prefix(msg.size(), 0) + msg) || !recv_all(fd, prefix, sizeof(prefix)) ||
      !tw::net::decode_prefix(prefix, &p).empty()) {
    ::close(fd);
    return -1;
  }
  std::string reply(p.header_length, '\0');
  if (!recv_all(fd, reply.data(), reply.size())) {
    ::close(fd);
    return -1;
  }
  td::ByteReader r(reply.data(), reply.size(), "HELLO reply");
  *status = tw::control::decode_header(r).status;
  if (body) *body = r.get_n(r.left());
  return fd;
}

}  // namespace

// While the victim waits on a call to its legitimate peer, a third peer
// answers every pending request id (read from the victim: better than any
// guess) on its own connection: the victim's call returns the real answer.
TEST(ModifiedPeer, ARepliesOnlyCountOnTheirOwnConnection) {
  tw::Device victim(config("tcp"));
  tw::Device legit(config("tcp"));
  std::atomic<bool> answer{false};
  legit.on_call("slow", [&](const std::string&) {
    wait_until([&] { return answer.load(); });
    return std::string("the real answer");
  });
  tw::Channel to_victim = legit.connect(victim.address());
  tw::Channel to_legit = victim.channel_to(legit.id());
  tw::control::Status status;
  int third = raw_hello(victim.address(), 0x7777, &status);
  ASSERT_GE(third, 0);
  ASSERT_EQ(status, tw::control::Status::kOk);
  std::string got;
  std::thread caller([&] { got = to_legit.call("slow", "", kWait); });
  std::vector<std::uint64_t> ids;
  ASSERT_TRUE(wait_until([&] { return !(ids = victim.impl()->pending_call_ids()).empty(); }));
  const auto refused_before = victim.impl()->refusal_count();
  std::string forged;
  for (std::uint64_t rid = 1; rid <= 256; ++rid) ids.push_back(rid);  // and the ids the old counter gave
  for (std::uint64_t rid : ids) {
    tw::control::Header h;
    h.type = tw::control::MsgType::kCallReply;
    h.request_id = rid;
    const std::string msg = tw::control::encode(h, "the attacker's answer");
    forged += tw::net::encode_prefix(msg.size(), 0) + msg;
  }
  ASSERT_TRUE(send_all(third, forged));
  EXPECT_TRUE(wait_until([&] { return victim.impl()->refusal_count() > refused_before; }))
      << "the forged reply to the pending call was not refused";
  answer = true;
  caller.join();
  EXPECT_EQ(got, "the real answer");
  ::close(third);
}

// A peer that learned another peer's device id (from its HELLO reply) claims
// it in a HELLO of its own: refused, since the live holder of the id does not
// vouch for it; the same device connecting again (another address for the
// victim) is vouched for and admitted; with_caller handlers see true ids.
TEST(ModifiedPeer, AClaimedIdAnotherLiveConnectionHoldsIsRefused) {
  tw::Device victim(config("tcp"));
  tw::Device legit(config("tcp"));
  std::vector<std::uint64_t> callers;
  std::mutex callers_mu;
  victim.on_peer_call("who", [&](std::uint64_t caller, const std::string&) {
    std::lock_guard<std::mutex> lock(callers_mu);
    callers.push_back(caller);
    return std::string();
  });
  tw::Channel ch = legit.connect(victim.address());
  ch.call("who", "", kWait);
  tw::control::Status status;
  int impostor = raw_hello(victim.address(), legit.id(), &status);
  ASSERT_GE(impostor, 0);
  EXPECT_EQ(status, tw::control::Status::kIdentityRefused);
  ::close(impostor);
  // The legitimate device again, through another spelling of the victim's address: its own claim.
  auto [host, port] = tw::net::split_address(victim.address());
  ASSERT_EQ(host, "127.0.0.1");
  tw::Channel again = legit.connect("localhost:" + std::to_string(port));
  again.call("who", "", kWait);
  std::lock_guard<std::mutex> lock(callers_mu);
  EXPECT_EQ(callers, (std::vector<std::uint64_t>{legit.id(), legit.id()}));
  EXPECT_GE(victim.impl()->refusal_count(), 1u);
}

// ---- Bounded per-connection memory (issue 49 item 4) ----

// 200,000 gets of 1 KiB whose replies the peer does not read: the victim stops reading
// the peer's frames once kPauseReadingAt of replies wait, so its backlog stays
// bounded; once the peer reads, every get is answered.
TEST(ModifiedPeer, OverTcpUnreadRepliesStopTheVictimReading) {
  tw::Device victim(config("tcp"));
  tw::Device attacker(config("tcp"));
  tw::Block published = victim.allocate(4096);
  victim.publish("pub", published.descriptor());
  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);
  int lane = raw_lane(ch, victim.address());
  ASSERT_GE(lane, 0);
  constexpr int kGets = 200000;
  std::string gets;
  for (int i = 0; i < kGets; ++i) {
    td::DataHeader h;
    h.kind = td::MsgKind::kGet;
    h.token = ch.impl()->peer->hello.data_token;
    h.target = static_cast<std::uint64_t>(i) + 1;
    h.a = pub.descriptor().address;
    h.b = 1024;  // 200 MB of replies in all
    const std::string header = h.encode();
    gets += tw::net::encode_prefix(header.size(), 0) + header;
  }
  timeval tv{20, 0};
  setsockopt(lane, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  std::atomic<bool> sent{false};
  std::thread sender([&] { sent = send_all(lane, gets); });
  std::shared_ptr<tw::net::Conn> served;
  ASSERT_TRUE(wait_until([&] {
    auto peer = victim.impl()->peer_by_id(attacker.id());
    served = peer ? peer->inbound_lane(0, 0) : nullptr;
    return served && served->reading_paused();
  })) << "the victim never stopped reading a peer that leaves its replies unread";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // At most one frame past the mark (the pause is checked after each).
  const std::size_t backlog = served->queued();
  EXPECT_LE(backlog, tw::net::Conn::kPauseReadingAt) << backlog << " bytes of replies queued";
  EXPECT_TRUE(served->reading_paused());
  int answered = 0;
  for (; answered < kGets; ++answered) {
    td::DataHeader reply;
    std::string payload;
    if (!recv_frame(lane, &reply, &payload)) break;
    if (reply.kind != td::MsgKind::kGetData || reply.b != 0 || payload.size() != 1024) break;
  }
  sender.join();
  EXPECT_TRUE(sent.load());
  EXPECT_EQ(answered, kGets);
  EXPECT_FALSE(served->reading_paused());
  ::close(lane);
}

// Over shared memory the revocation binds only the target's own acts: a
// same-host peer that mapped the slab keeps reaching it after the free,
// the next owner's bytes included, until the slab goes (docs/contracts.md
// §11 says so; a device that must not be reached so maps nothing: transport
// tcp, or map_shared_memory off).
TEST(ModifiedPeer, OverSharedMemoryAMappingOutlivesAFree) {
  tw::Device victim(config("shm"));
  tw::Device attacker(config("shm"));
  auto published = std::make_unique<tw::Block>(victim.allocate(4096));
  void* const at = published->data();
  victim.publish("pub", published->descriptor());
  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);
  const td::RemoteRegionImpl::Access access = ch.impl()->lane().access(pub);
  ASSERT_NE(access.mapped, nullptr);
  victim.unpublish("pub");
  published.reset();
  tw::Block next = victim.allocate(4096);
  ASSERT_EQ(next.data(), at);
  Secret owner("the block's next owner", next.data(), 4096);
  access.mapped[0] = static_cast<char>(~owner.was[0]);  // what a modified peer does with its mapping
  EXPECT_FALSE(owner.intact()) << "the contract says a mapping outlives a free: update §11 if this changed";
}

// The same over a registered heap array: the registration dropped and the
// array freed while a put lands, the rest goes nowhere (before: into the
// next heap allocation, or a crash once the pages were gone).
TEST(ModifiedPeer, OverTcpAPutLandingAcrossADroppedRegistrationMissesTheHeap) {
  tw::Device victim(config("tcp"));
  tw::Device attacker(config("tcp"));
  constexpr std::size_t kN = std::size_t(96) << 10;  // streamed, and under malloc's mmap threshold
  constexpr std::size_t kFirst = std::size_t(32) << 10;
  auto array = std::make_unique<std::vector<unsigned char>>(kN, 0);
  auto* const at = array->data();
  auto reg = std::make_unique<tw::Registration>(victim.pool().register_memory(array->data(), kN));
  victim.publish("pub", reg->descriptor());
  tw::Channel ch = attacker.connect(victim.address());
  tw::RemoteRegion pub = ch.lookup("pub", kWait);
  int lane = raw_lane(ch, victim.address());
  ASSERT_GE(lane, 0);
  ASSERT_TRUE(send_all(lane, put_frame(ch, pub.descriptor().address, kN) + std::string(kFirst, '\xee')));
  ASSERT_TRUE(wait_until([&] { return at[kFirst - 1] == 0xee; })) << "the first part never landed";
  victim.unpublish("pub");
  reg.reset();  // the grant ends with the registration
  array.reset();
  auto next = std::make_unique<std::vector<unsigned char>>(kN);
  Secret owner("the next heap allocation", next->data(), kN);
  ASSERT_TRUE(send_all(lane, std::string(kN - kFirst, '\xee')));
  td::DataHeader reply;
  std::string payload;
  ASSERT_TRUE(recv_frame(lane, &reply, &payload)) << "the put was not answered";
  EXPECT_EQ(reply.kind, td::MsgKind::kPutDone);
  EXPECT_EQ(reply.b, static_cast<std::uint64_t>(td::AccessStatus::kFailed));
  EXPECT_TRUE(owner.intact()) << "the rest of a put landed in the heap"
                              << (next->data() == at ? " (the next allocation took the array's bytes)" : "");
  ::close(lane);
}
