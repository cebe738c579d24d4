// Copyright tensorwire authors.
//
// The dynamic slot's record (protocol/dynamic_record.h; docs/contracts.md
// §10.4): bytes a lying sender writes into the receiver's memory. decode_record
// never throws; it accepts or names a reason. Input layout:
//   u8 max_ndim selector (-1..65: both ends out of range) | u8 mode |
//   u64 max_nbytes | record bytes
// Mode bit 0 clear: the record bytes are copied into a zeroed buffer of the
// slot's real record size (as DynamicSlot passes them); set: passed as they
// are, so short records reach the decoder too.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_common.h"
#include "protocol/dynamic_record.h"

namespace td = tensorwire::detail;

namespace {

template <typename T>
T take(const std::uint8_t*& p, std::size_t& left) {
  T v{};
  std::memcpy(&v, p, sizeof(T));
  p += sizeof(T);
  left -= sizeof(T);
  return v;
}

bool in_range(int max_ndim) { return max_ndim >= 0 && max_ndim <= td::kRecordMaxNdim; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 10) return 0;
  const int max_ndim = take<std::uint8_t>(data, size) % (td::kRecordMaxNdim + 3) - 1;
  const bool raw = take<std::uint8_t>(data, size) & 1;
  const std::size_t max_nbytes = take<std::uint64_t>(data, size);

  // Exactly sized heap copies, so ASan sees any read past the record.
  std::vector<char> record;
  if (raw || !in_range(max_ndim)) {
    record.assign(data, data + size);
  } else {
    record.assign(td::record_size_for(max_ndim) - 64, 0);
    std::memcpy(record.data(), data, std::min(size, record.size()));
  }

  // The message form's inline records (contracts §12) are what the header of
  // a dynamic-send message holds: any length, no rkey or address allowed.
  {
    td::DynamicRecord inl;
    const auto st = td::decode_record(data, size, max_ndim, max_nbytes, &inl, td::RecordForm::kInlineData);
    if (st == td::kAccepted) {
      TW_FUZZ_CHECK(inl.spec.dtype.valid() && inl.nbytes == inl.spec.nbytes() && inl.nbytes <= max_nbytes);
      TW_FUZZ_CHECK(inl.rkey.empty() && inl.address == 0);
    }
  }

  td::DynamicRecord rec;
  const auto status = td::decode_record(record.data(), record.size(), max_ndim, max_nbytes, &rec);
  TW_FUZZ_CHECK(std::strlen(td::describe_record_status(status)) > 0);
  if (!in_range(max_ndim)) TW_FUZZ_CHECK(status == td::kBadNdim);
  if (status != td::kAccepted) return 0;

  // What the receiver relies on before it allocates and RDMA-reads.
  TW_FUZZ_CHECK(rec.spec.dtype.valid());
  TW_FUZZ_CHECK(rec.spec.shape.size() <= static_cast<std::size_t>(max_ndim));
  TW_FUZZ_CHECK(rec.nbytes == rec.spec.nbytes());
  TW_FUZZ_CHECK(rec.nbytes <= max_nbytes);
  TW_FUZZ_CHECK(rec.rkey.size() <= td::kRecordMaxRkey);
  TW_FUZZ_CHECK(rec.nbytes == 0 || !rec.rkey.empty());
  TW_FUZZ_CHECK(rec.address + rec.nbytes >= rec.address);  // does not wrap

  // Round trip through the sender's encoder, into a real-size record.
  std::vector<char> again(td::record_size_for(max_ndim));
  const std::size_t used = td::encode_record(rec, max_ndim, again.data());
  TW_FUZZ_CHECK(used <= again.size() - 64);  // never touches the sequence line
  td::DynamicRecord back;
  TW_FUZZ_CHECK(td::decode_record(again.data(), again.size() - 64, max_ndim, max_nbytes, &back) == td::kAccepted);
  TW_FUZZ_CHECK(back.spec.dtype == rec.spec.dtype && back.spec.shape == rec.spec.shape);
  TW_FUZZ_CHECK(back.nbytes == rec.nbytes && back.address == rec.address && back.rkey == rec.rkey);
  TW_FUZZ_CHECK(back.device_id == rec.device_id);
  return 0;
}
