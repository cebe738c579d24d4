// Copyright tensorwire authors.
//
// The receive path of tensorwire's own tcp transport (net/socket.h): the
// input is the byte stream a peer sends on a connection. It is written into
// one end of a socketpair in two parts (split where the input's last byte
// says), then EOF; the other end is a real net::Conn on a
// net::Poller, whose frame handler decodes each header the way a data lane
// does (a lane introduction or a data message header and its extra bytes,
// cpp/src/core/messages.h) and lands each payload of at most kEagerMax + 4 KiB
// into an exactly sized buffer (ASan sees any byte landed past it); a longer
// one is not landed, so the Conn must read and drop it.
//
// Checked against an independent parse of the input: the frames delivered
// (count, headers, payload lengths and bytes), that a bad prefix ends the
// connection with "protocol error: ...", that the close handler runs once
// (EOF), a streamed payload's done(false) and where its bytes landed, and that
// progress() gets there in a bounded number of turns (no hang).
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/bytes.h"
#include "core/messages.h"
#include "fuzz_common.h"
#include "net/socket.h"
#include "protocol/dynamic_record.h"
#include "tensorwire/region.h"

namespace net = tensorwire::net;
namespace td = tensorwire::detail;
using tensorwire::RegionDescriptor;

namespace {

// Inputs are at most this long (tests/fuzz/run.sh's -max_len); a streamed
// payload up to kEagerMax + kMaxInput is landed, a longer one discarded, so
// no buffer is sized from a length field beyond what an input could fill.
constexpr std::size_t kMaxInput = 4096;
constexpr std::uint64_t kLandStreamedMax = net::kEagerMax + kMaxInput;
constexpr unsigned char kUntouched = 0xa5;

std::uint32_t le32(const std::uint8_t* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24;
}
std::uint64_t le64(const std::uint8_t* p) { return std::uint64_t(le32(p)) | std::uint64_t(le32(p + 4)) << 32; }

// What the receiver must see, from the input alone.
struct Expected {
  struct Frame {
    std::size_t header_at, header_length;
    std::uint64_t payload_length;
    std::size_t payload_at;  // its first byte in the input
  };
  std::vector<Frame> frames;
  bool protocol_error = false;
};

Expected parse(const std::uint8_t* data, std::size_t size) {
  Expected e;
  std::size_t pos = 0;
  for (;;) {
    if (size - pos < 16) return e;  // EOF mid-prefix (or at a frame boundary)
    const std::uint8_t* p = data + pos;
    const std::uint32_t header_length = le32(p + 4);
    const std::uint64_t payload_length = le64(p + 8);
    if (std::memcmp(p, "TWSK", 4) != 0 || header_length > (1u << 20) + 4096 ||
        payload_length > (std::uint64_t(1) << 40)) {
      e.protocol_error = true;
      return e;
    }
    const bool eager = payload_length <= (64u << 10);
    const std::uint64_t need = 16 + std::uint64_t(header_length) + (eager ? payload_length : 0);
    if (size - pos < need) return e;  // EOF before the frame is whole: never delivered
    e.frames.push_back({pos + 16, header_length, payload_length, pos + 16 + header_length});
    if (!eager) return e;  // streamed: longer than any input, so EOF comes while it streams
    pos += need;
  }
}

struct State {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
  Expected expected;
  std::size_t frames = 0;
  unsigned closes = 0;
  std::string why;
  // A streamed payload landed into `streamed` (at most one: the last frame).
  std::vector<unsigned char> streamed;
  bool streamed_landed = false;
  unsigned streamed_dones = 0;
  bool streamed_ok = false;
  std::size_t streamed_at = 0;
};

bool same(const char* a, const std::uint8_t* b, std::size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

// The kind-specific bytes after a data message header, read the way their
// receivers read them (messages.cc, protocol/dynamic_slot.cc).
void decode_extra(const td::DataHeader& h, td::ByteReader& r) {
  switch (h.kind) {
    case td::MsgKind::kPutFlagged: tw_fuzz::decode_or_refuse([&] { return r.get<std::uint64_t>(); }); break;
    case td::MsgKind::kDynamicSend: {
      const std::string bytes = r.get_n(r.left());
      td::DynamicRecord rec;
      const auto st = td::decode_record(bytes.data(), bytes.size(), td::kRecordMaxNdim, ~std::size_t(0), &rec,
                                        td::RecordForm::kInlineData);
      if (st == td::kAccepted) {
        TW_FUZZ_CHECK(rec.spec.dtype.valid() && rec.nbytes == rec.spec.nbytes());
        TW_FUZZ_CHECK(rec.rkey.empty() && rec.address == 0);
      }
      break;
    }
    case td::MsgKind::kDynamicAck: {
      if (r.left() == 0) break;
      auto offer = tw_fuzz::decode_or_refuse([&] {
        std::string landing = r.get_bytes32();
        r.get<std::uint64_t>();
        return landing;
      });
      if (offer) {
        tw_fuzz::decode_or_refuse([&] { return RegionDescriptor::from_bytes(offer->data(), offer->size()); });
      }
      break;
    }
    default: break;
  }
}

void on_frame(State& s, const char* header, std::size_t header_length, net::Payload& payload) {
  TW_FUZZ_CHECK(s.closes == 0);
  TW_FUZZ_CHECK(s.frames < s.expected.frames.size());
  const Expected::Frame& f = s.expected.frames[s.frames++];
  TW_FUZZ_CHECK(header_length == f.header_length);
  TW_FUZZ_CHECK(same(header, s.data + f.header_at, header_length));
  TW_FUZZ_CHECK(payload.length() == f.payload_length);

  // The headers a data lane decodes: at most one of the two accepts it.
  td::LaneIntro intro;
  const auto is_intro = tw_fuzz::decode_or_refuse([&] { return td::LaneIntro::decode(header, header_length, &intro); });
  TW_FUZZ_CHECK(is_intro.has_value());  // decode() refuses by returning false, never by throwing
  if (*is_intro) {
    TW_FUZZ_CHECK(header_length == td::LaneIntro::kSize);
    TW_FUZZ_CHECK(intro.encode() == std::string(header, header_length));
  }
  td::ByteReader r(header, header_length, "data message");
  const auto h = tw_fuzz::decode_or_refuse([&] { return td::DataHeader::decode(r); });
  if (h) {
    TW_FUZZ_CHECK(!*is_intro);
    TW_FUZZ_CHECK(header_length - r.left() == td::DataHeader::kSize);
    // Re-encodes to its bytes but the reserved ones (offsets 5..7).
    const std::string again = h->encode();
    TW_FUZZ_CHECK(again.size() == td::DataHeader::kSize);
    TW_FUZZ_CHECK(std::memcmp(again.data(), header, 5) == 0);
    TW_FUZZ_CHECK(std::memcmp(again.data() + 8, header + 8, td::DataHeader::kSize - 8) == 0);
    decode_extra(*h, r);
  }

  const std::uint64_t length = payload.length();
  if (length <= net::kEagerMax) {
    // Eager: whole in the receive buffer, landed at once.
    TW_FUZZ_CHECK(payload.data() != nullptr);
    TW_FUZZ_CHECK(same(payload.data(), s.data + f.payload_at, length));
    std::vector<char> into(length);
    unsigned dones = 0;
    bool ok = false;
    payload.land(into.data(), [&](bool o) {
      ++dones;
      ok = o;
    });
    TW_FUZZ_CHECK(dones == 1 && ok);
    TW_FUZZ_CHECK(same(into.data(), s.data + f.payload_at, length));
    return;
  }
  TW_FUZZ_CHECK(payload.data() == nullptr);
  if (length <= kLandStreamedMax) {
    // Streamed from the socket into exactly length() bytes; EOF comes first.
    s.streamed.assign(length, kUntouched);
    s.streamed_landed = true;
    s.streamed_at = f.payload_at;
    State* sp = &s;
    payload.land(s.streamed.data(), [sp](bool o) {
      ++sp->streamed_dones;
      sp->streamed_ok = o;
    });
  }
  // Longer: not landed, so it must be read and dropped.
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Every bad prefix logs a warning: quiet unless asked.
  setenv("TENSORWIRE_LOG", "error", 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > kMaxInput) return 0;  // the model below assumes a streamed payload outlasts the input
  State s;
  s.data = data;
  s.size = size;
  s.expected = parse(data, size);

  int fds[2];
  TW_FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  const int peer = fds[1];
  {
    net::Poller poller;
    auto conn = std::make_shared<net::Conn>(fds[0], "fuzz");
    poller.add(
        conn,
        [&s](const std::shared_ptr<net::Conn>&, const char* header, std::size_t header_length, net::Payload& payload) {
          on_frame(s, header, header_length, payload);
        },
        [&s](const std::shared_ptr<net::Conn>&, const std::string& why) {
          ++s.closes;
          s.why = why;
          // Every frame was delivered before the end.
          TW_FUZZ_CHECK(s.frames == s.expected.frames.size());
        });

    // In two writes (at most 4 KiB: the socket's buffer takes each at once),
    // the receiver's turns in between, then EOF. The split point is up to the
    // input (its last byte), so frames and streamed payloads arrive in pieces.
    const std::size_t split = size ? data[size - 1] * size / 256 : 0;
    auto put = [&](std::size_t from, std::size_t to) {
      while (from < to) {
        const ssize_t w = ::send(peer, data + from, to - from, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        TW_FUZZ_CHECK(w > 0);
        from += static_cast<std::size_t>(w);
      }
    };
    put(0, split);
    for (int turn = 0; turn < 2 && s.closes == 0; ++turn) poller.progress(0);
    if (s.closes == 0) {
      put(split, size);
    } else {
      TW_FUZZ_CHECK(s.expected.protocol_error);  // nothing else ends it before EOF
    }
    TW_FUZZ_CHECK(::shutdown(peer, SHUT_WR) == 0);
    // A turn handles up to 256 frames (a 4 KiB input holds at most 256).
    for (int turn = 0; turn < 16 && s.closes == 0; ++turn) poller.progress(0);
    TW_FUZZ_CHECK(s.closes == 1);  // no hang: EOF (or a protocol error) ends the connection
    TW_FUZZ_CHECK(poller.empty());
    TW_FUZZ_CHECK(conn->closed());
  }
  ::close(peer);

  TW_FUZZ_CHECK(s.frames == s.expected.frames.size());
  if (s.expected.protocol_error) {
    TW_FUZZ_CHECK(s.why.rfind("protocol error", 0) == 0);
  } else {
    TW_FUZZ_CHECK(s.why == "closed by the peer");
  }
  if (s.streamed_landed) {
    // done(false) once, after every byte the input held landed in order, none past them.
    TW_FUZZ_CHECK(s.streamed_dones == 1 && !s.streamed_ok);
    const std::size_t got = size - s.streamed_at;
    TW_FUZZ_CHECK(got < s.streamed.size());
    TW_FUZZ_CHECK(got == 0 || std::memcmp(s.streamed.data(), data + s.streamed_at, got) == 0);
    for (std::size_t i = got; i < s.streamed.size(); ++i) TW_FUZZ_CHECK(s.streamed[i] == kUntouched);
  }
  return 0;
}
