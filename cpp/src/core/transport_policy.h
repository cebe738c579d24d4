// Copyright tensorwire authors.
//
// A requested transport is a promise (docs/contracts.md §13): the families a
// device was asked for (its `transport` and `require`) must be among UCX's
// resources when the device is made, and a channel can say which ones its
// lanes use. One table maps UCX's transport names to the families.
#pragma once

#include <string>
#include <vector>

namespace tensorwire::detail {

// transport_family and unusable_reason are public (tensorwire/device.h).

// The families a device must offer: its transport (unless "auto") and the
// comma list `require`. InvalidArgument for an unknown name.
std::vector<std::string> required_families(const std::string& transport, const std::string& require);

}  // namespace tensorwire::detail
