// Copyright tensorwire authors.
//
// The HELLO body alone (docs/contracts.md §9.3), as handle_hello and the
// connecting side's HELLO_REPLY decode it. Accepted: encode_hello gives back
// exactly the bytes consumed (the rest is ignored by contract), and decoding
// that encoding gives the same fields.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/bytes.h"
#include "core/control_wire.h"
#include "fuzz_common.h"

namespace ctl = tensorwire::control;
using tensorwire::detail::ByteReader;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ByteReader r(data, size, "HELLO");
  auto hello = tw_fuzz::decode_or_refuse([&] { return ctl::decode_hello(r); });
  if (!hello) return 0;

  TW_FUZZ_CHECK(!hello->workers.empty() && hello->workers.size() <= 4096);
  const std::size_t used = size - r.left();
  const std::string bytes = ctl::encode_hello(*hello);
  TW_FUZZ_CHECK(bytes.size() == used);
  TW_FUZZ_CHECK(std::memcmp(bytes.data(), data, used) == 0);

  ByteReader again(bytes.data(), bytes.size(), "HELLO");
  const ctl::Hello back = ctl::decode_hello(again);
  TW_FUZZ_CHECK(again.left() == 0);
  TW_FUZZ_CHECK(back.device_id == hello->device_id && back.pid == hello->pid && back.start_time == hello->start_time &&
                back.boot_id == hello->boot_id && back.hostname == hello->hostname && back.address == hello->address &&
                back.token == hello->token && back.workers == hello->workers && back.self_proof == hello->self_proof);
  return 0;
}
