// Copyright tensorwire authors.
//
// A control message as DeviceImpl::on_message/dispatch decodes it
// (cpp/src/core/control_plane.cc; docs/contracts.md §9.2): the header, then the body
// its type calls for (a built-in export CALL carries a region descriptor).
// Only the decoding; no device is started. Accepted parts must re-encode to
// the bytes they were read from.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/bytes.h"
#include "core/control_wire.h"
#include "fuzz_common.h"
#include "tensorwire/region.h"

namespace ctl = tensorwire::control;
using tensorwire::RegionDescriptor;
using tensorwire::detail::ByteReader;
using tensorwire::detail::ByteWriter;

namespace {

constexpr std::size_t kHeaderSize = 20;

bool same_bytes(const std::string& s, const std::uint8_t* p, std::size_t n) {
  return s.size() == n && (n == 0 || std::memcmp(s.data(), p, n) == 0);
}

// The body, decoded the way dispatch() does for `type`; returns how many body
// bytes were consumed, or nothing when refused.
std::optional<std::size_t> decode_body(const ctl::Header& h, const std::uint8_t* body, std::size_t size) {
  return tw_fuzz::decode_or_refuse([&]() -> std::size_t {
    ByteReader r(body, size, "control message");
    switch (h.type) {
      case ctl::MsgType::kHello: {
        // handle_hello decodes the body only when the version matches.
        if (h.version != ctl::kProtocolVersion) return 0;
        ctl::Hello hello = ctl::decode_hello(r);
        TW_FUZZ_CHECK(same_bytes(ctl::encode_hello(hello), body, size - r.left()));
        break;
      }
      case ctl::MsgType::kHelloReply:
      case ctl::MsgType::kLookupReply:
      case ctl::MsgType::kCallReply: {
        std::string reply = r.get_n(r.left());
        TW_FUZZ_CHECK(same_bytes(reply, body, size));
        break;
      }
      case ctl::MsgType::kLookup: {
        std::string name = r.get_n(r.left());
        TW_FUZZ_CHECK(same_bytes(name, body, size));
        break;
      }
      case ctl::MsgType::kCall: {
        std::string name = r.get_bytes16();
        std::string payload = r.get_bytes32();
        ByteWriter w;
        w.put_bytes16(name);
        w.put_bytes32(payload);
        TW_FUZZ_CHECK(same_bytes(w.str(), body, size - r.left()));
        if (name == ctl::kExportCall) {
          const auto d = RegionDescriptor::from_bytes(payload.data(), payload.size());
          TW_FUZZ_CHECK(d.to_bytes().size() == payload.size());
        }
        break;
      }
      case ctl::MsgType::kPing:
      case ctl::MsgType::kPong: return 0;  // no body: whatever follows the header is ignored
      default: TW_FUZZ_CHECK(!"decode_header let an unknown type through");
    }
    return size - r.left();
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ByteReader r(data, size, "control message");
  auto h = tw_fuzz::decode_or_refuse([&] { return ctl::decode_header(r); });
  if (!h) return 0;

  TW_FUZZ_CHECK(size - r.left() == kHeaderSize);
  const auto type = static_cast<unsigned>(h->type);
  TW_FUZZ_CHECK(type >= 1 && type <= ctl::kMaxMsgType);
  // The header re-encodes to its bytes but the reserved byte at offset 7.
  const std::string head = ctl::encode(*h, "");
  TW_FUZZ_CHECK(head.size() == kHeaderSize);
  TW_FUZZ_CHECK(std::memcmp(head.data(), data, 7) == 0);
  TW_FUZZ_CHECK(std::memcmp(head.data() + 8, data + 8, kHeaderSize - 8) == 0);

  auto used = decode_body(*h, data + kHeaderSize, r.left());
  if (used) TW_FUZZ_CHECK(*used <= r.left());
  return 0;
}
