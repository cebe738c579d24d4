// Copyright tensorwire authors.
//
// The one dtype table: names, DLPack codes, buffer-protocol formats. Python's
// dtype names (tensorwire._DTYPES) and the bindings' views come from here.
#include <algorithm>
#include <string>
#include <vector>

#include "tensorwire/error.h"
#include "tensorwire/slot.h"

namespace tensorwire {

const std::vector<DTypeInfo>& dtypes() {
  // DLPack codes: 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool.
  static const std::vector<DTypeInfo> table = {
      {"float16", {2, 16}, "e"},    {"float32", {2, 32}, "f"},      {"float64", {2, 64}, "d"},
      {"bfloat16", {4, 16}, "H"},  // no buffer-protocol code: numpy sees the raw uint16 word
      {"int8", {0, 8}, "b"},        {"int16", {0, 16}, "h"},        {"int32", {0, 32}, "i"},
      {"int64", {0, 64}, "q"},      {"uint8", {1, 8}, "B"},         {"uint16", {1, 16}, "H"},
      {"uint32", {1, 32}, "I"},     {"uint64", {1, 64}, "Q"},       {"bool", {6, 8}, "?"},
      {"complex64", {5, 64}, "Zf"}, {"complex128", {5, 128}, "Zd"},  // (re, im) pairs; numpy's formats
  };
  return table;
}

namespace {
const DTypeInfo* find(const DType& d) {
  const auto& t = dtypes();
  auto it = std::find_if(t.begin(), t.end(), [&](const DTypeInfo& i) { return i.dtype == d; });
  return it == t.end() ? nullptr : &*it;
}
}  // namespace

bool DType::valid() const { return find(*this) != nullptr; }

std::string DType::name() const {
  if (const DTypeInfo* i = find(*this)) return i->name;
  return "dtype(" + std::to_string(code) + "," + std::to_string(bits) + ")";
}

const char* DType::format() const {
  const DTypeInfo* i = find(*this);
  return i ? i->format : "";
}

DType DType::from_name(const std::string& name) {
  for (const auto& i : dtypes()) {
    if (name == i.name) return i.dtype;
  }
  std::string known;
  for (const auto& i : dtypes()) known += (known.empty() ? "" : ", ") + std::string(i.name);
  throw InvalidArgument("unsupported dtype '" + name + "'; supported: " + known);
}

}  // namespace tensorwire
