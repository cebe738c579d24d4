// Copyright tensorwire authors.
#include "protocol/dynamic_record.h"

#include <cstring>

#include "tensorwire/error.h"

namespace tensorwire::detail {

namespace {
std::size_t align64(std::size_t v) { return (v + 63) & ~std::size_t(63); }
template <typename T>
T read_at(const char* p, std::size_t offset) {
  T v;
  std::memcpy(&v, p + offset, sizeof(T));
  return v;
}
template <typename T>
void write_at(char* p, std::size_t offset, T v) {
  std::memcpy(p + offset, &v, sizeof(T));
}
}  // namespace

const char* describe_record_status(std::uint64_t status) {
  switch (status) {
    case kAccepted: return "accepted";
    case kBadMagic: return "bad magic";
    case kBadVersion: return "unknown record version";
    case kBadDtype: return "unknown dtype";
    case kBadNdim: return "too many dimensions";
    case kBadDims: return "negative dimension";
    case kSizeMismatch: return "nbytes does not match the shape and dtype";
    case kTooLarge: return "nbytes exceeds the slot's limit";
    case kBadRkey: return "bad remote key";
    case kReadFailed: return "reading the data failed";
    case kNotExported: return "the data range is not one the sender exported to the receiver";
    case kPoolExhausted: return "the receiver's memory pool is exhausted";
    default: return "refused";
  }
}

std::size_t record_size_for(int max_ndim) {
  if (max_ndim < 0 || max_ndim > kRecordMaxNdim) {
    throw InvalidArgument("max_ndim must be in 0.." + std::to_string(kRecordMaxNdim));
  }
  return align64(kRecordHeader + 8 * static_cast<std::size_t>(max_ndim) + kRecordMaxRkey) + 64;
}

std::size_t encode_record(const DynamicRecord& r, int max_ndim, char* p, RecordForm form) {
  if (r.spec.shape.size() > static_cast<std::size_t>(max_ndim)) {
    throw InvalidArgument("the slot takes at most " + std::to_string(max_ndim) + " dimensions, got " +
                          r.spec.describe());
  }
  if (form == RecordForm::kInlineData) {
    if (!r.rkey.empty() || r.address != 0) throw InvalidArgument("an inline-data record carries no address or rkey");
  } else if (r.rkey.size() > kRecordMaxRkey || (r.nbytes > 0 && r.rkey.empty())) {
    throw InvalidArgument("local memory has no usable rkey");
  }
  const std::size_t dims_end = kRecordHeader + 8 * static_cast<std::size_t>(max_ndim);
  std::memset(p, 0, dims_end);
  write_at<std::uint32_t>(p, 0, kRecordMagic);
  write_at<std::uint16_t>(p, 4, kRecordVersion);
  write_at<std::uint8_t>(p, 6, r.spec.dtype.code);
  write_at<std::uint8_t>(p, 7, r.spec.dtype.bits);
  write_at<std::uint32_t>(p, 8, static_cast<std::uint32_t>(r.spec.shape.size()));
  write_at<std::uint32_t>(p, 12, static_cast<std::uint32_t>(r.rkey.size()));
  write_at<std::uint64_t>(p, 16, r.nbytes);
  write_at<std::uint64_t>(p, 24, r.address);
  write_at<std::uint64_t>(p, 32, r.device_id);
  if (!r.spec.shape.empty()) std::memcpy(p + kRecordHeader, r.spec.shape.data(), 8 * r.spec.shape.size());
  if (!r.rkey.empty()) std::memcpy(p + dims_end, r.rkey.data(), r.rkey.size());
  return dims_end + r.rkey.size();
}

RecordStatus decode_record(const void* data, std::size_t size, int max_ndim, std::size_t max_nbytes, DynamicRecord* out,
                           RecordForm form) {
  if (max_ndim < 0 || max_ndim > kRecordMaxNdim) return kBadNdim;
  const bool inline_data = form == RecordForm::kInlineData;
  const std::size_t dims_end = kRecordHeader + 8 * static_cast<std::size_t>(max_ndim);
  if (size < dims_end + (inline_data ? 0 : kRecordMaxRkey)) return kBadMagic;  // not a whole record
  const char* p = static_cast<const char*>(data);
  if (read_at<std::uint32_t>(p, 0) != kRecordMagic) return kBadMagic;
  if (read_at<std::uint16_t>(p, 4) != kRecordVersion) return kBadVersion;
  out->spec.dtype.code = read_at<std::uint8_t>(p, 6);
  out->spec.dtype.bits = read_at<std::uint8_t>(p, 7);
  if (!out->spec.dtype.valid()) return kBadDtype;
  const auto ndim = read_at<std::uint32_t>(p, 8);
  const auto rkey_len = read_at<std::uint32_t>(p, 12);
  out->nbytes = read_at<std::uint64_t>(p, 16);
  out->address = read_at<std::uint64_t>(p, 24);
  out->device_id = read_at<std::uint64_t>(p, 32);
  if (ndim > static_cast<std::uint32_t>(max_ndim)) return kBadNdim;
  out->spec.shape.resize(ndim);
  if (ndim) std::memcpy(out->spec.shape.data(), p + kRecordHeader, 8 * static_cast<std::size_t>(ndim));
  for (auto d : out->spec.shape) {
    if (d < 0) return kBadDims;
  }
  std::size_t expect;
  try {
    expect = out->spec.nbytes();
  } catch (const InvalidArgument&) {
    return kTooLarge;
  }
  if (expect != out->nbytes) return kSizeMismatch;
  if (out->nbytes > max_nbytes) return kTooLarge;
  if (inline_data) {
    // The data is the message's payload: a record that names memory lies.
    if (rkey_len != 0 || out->address != 0) return kBadRkey;
    out->rkey.clear();
    return kAccepted;
  }
  if (out->nbytes > 0 && (rkey_len == 0 || rkey_len > kRecordMaxRkey)) return kBadRkey;
  if (out->nbytes > 0 && out->address + out->nbytes < out->address) return kTooLarge;  // wraps around
  out->rkey.assign(p + dims_end, out->nbytes > 0 ? rkey_len : 0);
  return kAccepted;
}

}  // namespace tensorwire::detail
