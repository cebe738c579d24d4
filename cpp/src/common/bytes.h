// Copyright tensorwire authors.
//
// Little-endian byte writer and a bounds-checked reader for the wire formats
// (region descriptors, control messages). The reader never trusts a length
// field: every read is checked against the bytes actually received.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "tensorwire/error.h"

namespace tensorwire::detail {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire formats assume a little-endian host");

class ByteWriter {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_integral_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_bytes16(std::string_view s) {
    if (s.size() > 0xffff) throw InvalidArgument("field too long for the wire format (max 65535 bytes)");
    put<std::uint16_t>(static_cast<std::uint16_t>(s.size()));
    out_.append(s);
  }
  void put_bytes32(std::string_view s) {
    if (s.size() > 0xffffffffu) throw InvalidArgument("field too long for the wire format");
    put<std::uint32_t>(static_cast<std::uint32_t>(s.size()));
    out_.append(s);
  }
  void put_raw(std::string_view s) { out_.append(s); }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class ByteReader {
 public:
  ByteReader(const void* data, std::size_t size, const char* what)
      : p_(static_cast<const char*>(data)), left_(size), what_(what) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    advance(sizeof(T));
    return v;
  }
  std::string get_bytes16() { return get_n(get<std::uint16_t>()); }
  std::string get_bytes32() { return get_n(get<std::uint32_t>()); }
  std::string get_n(std::size_t n) {
    need(n);
    std::string s(p_, n);
    advance(n);
    return s;
  }
  std::size_t left() const { return left_; }

 private:
  void need(std::size_t n) const {
    if (n > left_) throw InvalidArgument(std::string("truncated ") + what_);
  }
  void advance(std::size_t n) {
    p_ += n;
    left_ -= n;
  }
  const char* p_;
  std::size_t left_;
  const char* what_;
};

}  // namespace tensorwire::detail
