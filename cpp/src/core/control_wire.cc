// Copyright tensorwire authors.
#include "core/control_wire.h"

namespace tensorwire::control {

std::string encode(const Header& h, std::string_view body) {
  detail::ByteWriter w;
  w.put<std::uint32_t>(kMagic);
  w.put<std::uint16_t>(h.version);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(h.type));
  w.put<std::uint8_t>(0);
  w.put<std::uint64_t>(h.request_id);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(h.status));
  w.put_raw(body);
  return std::move(w.str());
}

Header decode_header(detail::ByteReader& r) {
  if (r.get<std::uint32_t>() != kMagic) throw InvalidArgument("control message with a bad magic");
  Header h;
  h.version = r.get<std::uint16_t>();
  auto type = r.get<std::uint8_t>();
  if (type < 1 || type > kMaxMsgType) throw InvalidArgument("control message of unknown type " + std::to_string(type));
  h.type = static_cast<MsgType>(type);
  r.get<std::uint8_t>();
  h.request_id = r.get<std::uint64_t>();
  h.status = static_cast<Status>(r.get<std::uint32_t>());
  return h;
}

std::string encode_hello(const Hello& m) {
  detail::ByteWriter w;
  w.put<std::uint64_t>(m.device_id);
  w.put<std::uint32_t>(m.pid);
  w.put<std::uint64_t>(m.start_time);
  w.put_bytes16(m.boot_id);
  w.put_bytes16(m.hostname);
  w.put_bytes16(m.address);
  w.put_bytes16(m.token);
  if (m.workers.size() > 4096) throw InvalidArgument("too many workers");
  w.put<std::uint16_t>(static_cast<std::uint16_t>(m.workers.size()));
  for (const auto& a : m.workers) w.put_bytes32(a);
  w.put_bytes16(m.self_proof);
  w.put<std::uint64_t>(m.data_token);
  return std::move(w.str());
}

Hello decode_hello(detail::ByteReader& r) {
  Hello m;
  m.device_id = r.get<std::uint64_t>();
  m.pid = r.get<std::uint32_t>();
  m.start_time = r.get<std::uint64_t>();
  m.boot_id = r.get_bytes16();
  m.hostname = r.get_bytes16();
  m.address = r.get_bytes16();
  m.token = r.get_bytes16();
  auto n = r.get<std::uint16_t>();
  if (n == 0 || n > 4096) throw InvalidArgument("HELLO with an invalid worker count");
  for (unsigned i = 0; i < n; ++i) m.workers.push_back(r.get_bytes32());
  m.self_proof = r.get_bytes16();
  m.data_token = r.get<std::uint64_t>();
  return m;
}

}  // namespace tensorwire::control
