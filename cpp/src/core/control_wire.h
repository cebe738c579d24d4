// Copyright tensorwire authors.
//
// Control-plane messages, carried as UCX active messages (always eager; never
// on the data path). Every message starts with the same header:
//   u32 magic "TWCP" | u16 protocol version | u8 type | u8 reserved
//   u64 request id | u32 status | body...
// Bodies are documented in docs/contracts.md; all fields little-endian,
// strings and byte strings length-prefixed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/bytes.h"

namespace tensorwire::control {

constexpr std::uint16_t kProtocolVersion = 1;
constexpr std::uint32_t kMagic = 0x50435754;  // "TWCP"
constexpr unsigned kAmId = 0x7477;            // the one AM id of the control plane
constexpr std::size_t kMaxMessage = 1 << 20;  // calls and replies above this are refused
// The built-in call by which a peer exports a range to us (Channel::export_region).
inline constexpr const char* kExportCall = "tw.export";
// The built-in call by which the peer that accepted our connection asks us,
// its dialer, for a tcp lane (payload: the lane, u32): we dial it, and both
// directions of that lane share the socket (Peer::lane_from_dialer).
inline constexpr const char* kLaneCall = "tw.lane";
// The built-in call by which a device asks a connected peer whether a new
// connection that claims that peer's device id is its own (payload: the data
// token of the new connection's HELLO, u64): OK when it is one of the peer's
// pending connects, refused otherwise (DeviceImpl::handle_hello).
inline constexpr const char* kClaimCall = "tw.claim";

enum class MsgType : std::uint8_t {
  kHello = 1,
  kHelloReply = 2,
  kLookup = 3,
  kLookupReply = 4,
  kCall = 5,
  kCallReply = 6,
  kPing = 7,
  kPong = 8,  // liveness: a device pings a peer it has not heard from lately
};
constexpr std::uint8_t kMaxMsgType = 8;

enum class Status : std::uint32_t {
  kOk = 0,
  kNotFound = 1,
  kVersionMismatch = 2,
  kTokenMismatch = 3,
  kHandlerError = 4,
  kBadMessage = 5,
  kInvalidArgument = 6,  // a handler refused the call's argument
  kIdentityRefused = 7,  // HELLO claims a device id that is not the sender's to claim
  kNoHello = 8,          // LOOKUP or CALL on a connection that has not said HELLO
};

struct Header {
  std::uint16_t version = kProtocolVersion;
  MsgType type = MsgType::kHello;
  std::uint64_t request_id = 0;
  Status status = Status::kOk;
};

struct Hello {
  std::uint64_t device_id = 0;
  std::uint32_t pid = 0;
  std::uint64_t start_time = 0;  // process start time (clock ticks since boot)
  std::string boot_id;
  std::string hostname;
  std::string address;  // the sender's listening address
  std::string token;
  std::vector<std::string> workers;  // packed UCP worker addresses, one per worker
  // Only when a device connects to its own address: a secret that never
  // leaves the process, proving that a HELLO claiming the receiver's own
  // device id comes from the receiver itself. Empty otherwise.
  std::string self_proof;
  // The token the receiver of this HELLO must put in every data message it
  // sends to the sender (core/messages.h): the sender chose it for this
  // connection alone, so a data message proves which peer sent it.
  std::uint64_t data_token = 0;
};

std::string encode(const Header& header, std::string_view body);
// Reads and checks the magic; the version is returned, not checked (the
// receiver decides what a mismatch means).
Header decode_header(detail::ByteReader& reader);
std::string encode_hello(const Hello& hello);
Hello decode_hello(detail::ByteReader& reader);

}  // namespace tensorwire::control
