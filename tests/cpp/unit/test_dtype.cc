// Copyright tensorwire authors.
//
// The one dtype table (protocol/dtype.cc): names, codes and formats agree,
// and what is not in it is refused.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "tensorwire/error.h"
#include "tensorwire/slot.h"

namespace tw = tensorwire;

TEST(DType, TableRoundTrips) {
  std::set<std::string> names;
  for (const auto& d : tw::dtypes()) {
    EXPECT_TRUE(names.insert(d.name).second) << "duplicate " << d.name;
    EXPECT_TRUE(d.dtype.valid()) << d.name;
    EXPECT_EQ(d.dtype.name(), d.name);
    EXPECT_EQ(tw::DType::from_name(d.name), d.dtype);
    EXPECT_STREQ(d.dtype.format(), d.format);
    EXPECT_EQ(d.dtype.itemsize() * 8, d.dtype.bits);
  }
  EXPECT_EQ(names.size(), 15u);
  EXPECT_EQ(tw::DType::from_name("bfloat16"), (tw::DType{4, 16}));
  EXPECT_STREQ((tw::DType{4, 16}).format(), "H");  // raw words: the buffer protocol has no bfloat16
  EXPECT_EQ(tw::DType::from_name("complex64"), (tw::DType{5, 64}));
  EXPECT_EQ((tw::DType{5, 128}).itemsize(), 16u);
  EXPECT_STREQ((tw::DType{5, 128}).format(), "Zd");
}

TEST(DType, RefusesWhatIsNotInTheTable) {
  for (tw::DType d :
       {tw::DType{2, 8}, tw::DType{4, 32}, tw::DType{6, 16}, tw::DType{3, 64}, tw::DType{0, 128}, tw::DType{5, 32}}) {
    EXPECT_FALSE(d.valid()) << d.name();
    EXPECT_STREQ(d.format(), "");
    EXPECT_EQ(d.name().rfind("dtype(", 0), 0u);
    tw::TensorSpec spec{{2}, d};
    EXPECT_THROW(spec.nbytes(), tw::InvalidArgument);
  }
  EXPECT_THROW(tw::DType::from_name("complex32"), tw::InvalidArgument);
  try {
    tw::DType::from_name("float8");
  } catch (const tw::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos) << e.what();  // lists what is supported
  }
}
