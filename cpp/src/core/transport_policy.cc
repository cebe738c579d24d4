// Copyright tensorwire authors.
#include "core/transport_policy.h"

#include <cstring>

#include "cuda/driver.h"
#include "tensorwire/device.h"
#include "tensorwire/error.h"

namespace tensorwire::detail {

namespace {
constexpr const char* kFamilies[] = {"tcp", "shm", "rdma", "cuda"};

struct Member {
  const char* transport;
  const char* family;
};
constexpr Member kMembers[] = {
    {"tcp", "tcp"},        {"posix", "shm"},     {"sysv", "shm"},      {"xpmem", "shm"},
    {"cma", "shm"},        {"knem", "shm"},      {"rc_verbs", "rdma"}, {"rc_mlx5", "rdma"},
    {"ud_verbs", "rdma"},  {"ud_mlx5", "rdma"},  {"dc_mlx5", "rdma"},  {"srd", "rdma"},
    {"cuda_copy", "cuda"}, {"cuda_ipc", "cuda"}, {"gdr_copy", "cuda"}, {"self", "self"},
};

std::string names_of(const std::vector<std::string>& resources) {
  std::string out;
  for (const auto& r : resources) out += (out.empty() ? "" : ", ") + r;
  return out.empty() ? "none" : out;
}
}  // namespace

std::vector<std::string> required_families(const std::string& transport, const std::string& require) {
  std::vector<std::string> out;
  auto add = [&](const std::string& f) {
    if (f.empty() || f == "auto") return;
    bool known = false;
    for (const char* k : kFamilies) known = known || f == k;
    if (!known) throw InvalidArgument("require: unknown transport '" + f + "' (tcp, shm, rdma or cuda)");
    for (const auto& o : out) {
      if (o == f) return;
    }
    out.push_back(f);
  };
  add(transport);
  for (std::size_t at = 0; at <= require.size();) {
    std::size_t end = require.find(',', at);
    if (end == std::string::npos) end = require.size();
    add(require.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

}  // namespace tensorwire::detail

namespace tensorwire {

std::string transport_family(const std::string& ucx_transport) {
  const std::string name = ucx_transport.substr(0, ucx_transport.find('/'));
  for (const auto& m : detail::kMembers) {
    if (name == m.transport) return m.family;
  }
  return "";
}

std::string unusable_reason(const std::vector<std::string>& resources, const std::string& family) {
  for (const auto& r : resources) {
    if (transport_family(r) == family) return "";
  }
  const std::string offered = "UCX offers " + detail::names_of(resources);
  if (family == "rdma") {
    return "no verbs transport (rc, ud, dc, srd) on an RDMA device: " + offered +
           ". The PyPI UCX wheel has no verbs: build with TENSORWIRE_UCX=system against a UCX with verbs "
           "(README, 'Which UCX'), on a machine with an RDMA device (/sys/class/infiniband)";
  }
  if (family == "cuda") {
    if (!cuda::available()) return "no GPU: " + cuda::unavailable_reason();
    return "this UCX has no CUDA transport (cuda_copy, cuda_ipc): " + offered;
  }
  if (family == "shm") return "no shared-memory transport (posix, sysv, xpmem, cma, knem): " + offered;
  return "no tcp transport on the devices UCX may use (UCX_NET_DEVICES, net_devices): " + offered;
}

}  // namespace tensorwire
