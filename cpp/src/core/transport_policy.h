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

// "tcp", "shm", "rdma", "cuda", "self", or "" for a UCX transport name
// ("rc_mlx5" -> "rdma", "posix" -> "shm", "cuda_ipc" -> "cuda").
std::string transport_family(const std::string& ucx_transport);

// The families a device must offer: its transport (unless "auto") and the
// comma list `require`. InvalidArgument for an unknown name.
std::vector<std::string> required_families(const std::string& transport, const std::string& require);

// Why `family` is not usable with these resources ("transport/device"), or
// "" when it is.
std::string unusable_reason(const std::vector<std::string>& resources, const std::string& family);

}  // namespace tensorwire::detail
