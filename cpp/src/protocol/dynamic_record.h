// Copyright tensorwire authors.
//
// The dynamic slot's metadata record: the one codec for its wire form
// (docs/contracts.md §10.4). Little-endian, `record_size_for(max_ndim)` bytes,
// the sequence word alone in the last 64-byte line:
//   0 u32 magic "TWDR" | 4 u16 version | 6 u8 dtype code | 7 u8 dtype bits
//   8 u32 ndim | 12 u32 rkey length | 16 u64 nbytes | 24 u64 sender address
//   32 u64 sender device id | 40 i64 dims[max_ndim] | rkey bytes (kMaxRkey)
//   record_size-64: u64 sequence
// The decoder trusts nothing it reads: it is what a lying sender reaches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "tensorwire/slot.h"

namespace tensorwire::detail {

constexpr std::uint32_t kRecordMagic = 0x52445754;  // "TWDR"
constexpr std::uint16_t kRecordVersion = 1;
constexpr std::size_t kRecordHeader = 40;
constexpr std::size_t kRecordMaxRkey = 2048;
constexpr int kRecordMaxNdim = 64;

// Status of a record, written into the sender's ack block by the receiver.
enum RecordStatus : std::uint64_t {
  kAccepted = 0,
  kBadMagic = 1,
  kBadVersion = 2,
  kBadDtype = 3,
  kBadNdim = 4,
  kBadDims = 5,
  kSizeMismatch = 6,
  kTooLarge = 7,
  kBadRkey = 8,
  kReadFailed = 9,
  kNotExported = 10,
  kPoolExhausted = 11,
};

const char* describe_record_status(std::uint64_t status);

// Bytes of a record for a slot of `max_ndim` dimensions (0..kRecordMaxNdim).
std::size_t record_size_for(int max_ndim);

struct DynamicRecord {
  TensorSpec spec;
  std::uint64_t nbytes = 0;
  std::uint64_t address = 0;    // where the data lies at the sender
  std::uint64_t device_id = 0;  // the sender's device (informational: identity comes from the connection)
  std::string rkey;             // packed rkey of the sender's range (empty when nbytes == 0)
};

// Where a record's data is: at the sender, read by the receiver with the
// record's address and rkey (the RMA form, written into the slot's record),
// or travelling with the record in the same message (the message form: rkey
// length 0, address 0, and the record ends after the dims).
enum class RecordForm { kRemoteData, kInlineData };

// Writes everything but the sequence word into `out` (at least
// record_size_for(max_ndim) bytes); returns how many leading bytes to send.
// Throws InvalidArgument for a record the receiver would refuse.
std::size_t encode_record(const DynamicRecord& record, int max_ndim, char* out,
                          RecordForm form = RecordForm::kRemoteData);

// Reads and validates a record of `size` bytes written for a slot of
// `max_ndim` dimensions that accepts at most `max_nbytes`. Returns kAccepted
// (and fills `out`) or the first reason to refuse it; never throws.
RecordStatus decode_record(const void* data, std::size_t size, int max_ndim, std::size_t max_nbytes, DynamicRecord* out,
                           RecordForm form = RecordForm::kRemoteData);

}  // namespace tensorwire::detail
