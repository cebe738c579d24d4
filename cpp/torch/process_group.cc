// Copyright tensorwire authors. The "tensorwire" c10d backend (process_group.h).
#include "process_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <set>
#include <sstream>

#include "tensorwire/collectives.h"
#include "tensorwire/device.h"
#include "tensorwire/error.h"
#include "tensorwire/messenger.h"
#include "tensorwire/slot.h"

namespace tensorwire::torch_backend {
namespace {

using c10d::OpType;
using TwOp = tensorwire::ReduceOp;

// Tags above every user tag (c10d's are ints) and apart from the collectives'
// (negative): the backend's own exchanges (monitoredBarrier).
constexpr std::int64_t kMonitorTag = std::int64_t(1) << 40;

// A sparse all_reduce's tensors have at most this many dimensions (its layout
// exchange has a fixed width).
constexpr int64_t kSparseMaxDims = 64;

std::exception_ptr backend_error(const std::string& msg) {
  return std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg));
}

[[noreturn]] void throw_backend_error(const std::string& msg) { std::rethrow_exception(backend_error(msg)); }

std::string env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// ---- the Device's configuration (python/tensorwire/ranks/world.py's choices) ----

// inline (the waiting rank drives its worker) where every peer is reached
// through shared memory, whose writes land without the target's help;
// blocking (a progress thread) elsewhere. TENSORWIRE_PROGRESS, read by the
// core, overrides it.
std::string progress_mode(const std::string& transport, int size) {
  if (transport == "shm") return "inline";
  if (transport != "auto") return "blocking";
  std::string tls = env("UCX_TLS");
  if (!tls.empty()) {
    bool shared = false;
    for (const char* t : {"all", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"}) {
      shared = shared || tls.find(t) != std::string::npos;
    }
    if (!shared) return "blocking";  // the user's UCX_TLS leaves no shared-memory transport
  }
  bool one_host = env("LOCAL_WORLD_SIZE") == std::to_string(size) || size == 1;
  return one_host ? "inline" : "blocking";
}

// Where the group's store lives: MASTER_ADDR, else the TCPStore's host
// (init_method tcp://, store=TCPStore), else this host.
std::string root_host(const c10::intrusive_ptr<c10d::Store>& store) {
  std::string addr = env("MASTER_ADDR");
  if (!addr.empty()) return addr;
  c10::intrusive_ptr<c10d::Store> s = store;
  if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(s.get())) s = prefix->getUnderlyingNonPrefixStore();
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get())) return tcp->getHost();
  return "127.0.0.1";
}

// The local address a connection to `host` leaves from (no packet is sent).
std::string local_host_towards(const std::string& host) {
  if (host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1") return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return "127.0.0.1";
  std::string out = "127.0.0.1";
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char text[INET_ADDRSTRLEN] = {};
    if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) != nullptr) {
      out = text;
    }
    ::close(fd);
  }
  freeaddrinfo(res);
  return out;
}

// The c10d store as the engine's rendezvous (keys live under the group's prefix).
class StoreRendezvous : public tensorwire::Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    try {
      store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    } catch (const c10::Error& e) {
      throw tensorwire::ConnectionError("c10d store: cannot set '" + key + "': " + e.what_without_backtrace());
    }
  }
  std::string get(const std::string& key, double timeout_s) override {
    try {
      store_->wait({key}, std::chrono::milliseconds(static_cast<int64_t>(std::max(timeout_s, 0.001) * 1000)));
      auto v = store_->get(key);
      return std::string(v.begin(), v.end());
    } catch (const c10::Error& e) {
      throw tensorwire::Timeout("c10d store: '" + key + "' was not set within " + std::to_string(timeout_s) +
                                " s: " + e.what_without_backtrace());
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// ---- tensors ----

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "tensorwire backend: ", what, " got an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "tensorwire backend: ", what, " takes CPU tensors, got one on ", t.device(),
                    " (give other devices to another backend: 'cpu:tensorwire,cuda:nccl')");
  TORCH_CHECK_VALUE(!t.is_sparse(), "tensorwire backend: ", what, " of sparse tensors is not supported (", what,
                    " t.to_dense(); all_reduce takes sparse COO tensors)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "tensorwire backend: ", what, " takes dense tensors, got layout ",
                    t.layout());
}

void check_tensors(const std::vector<at::Tensor>& ts, const char* what) {
  for (const auto& t : ts) check_tensor(t, what);
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* what) {
  check_tensor(t, what);
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type() && t.numel() == ref.numel(), "tensorwire backend: ", what,
                    " needs tensors of one size and dtype (", ref.numel(), " x ", ref.scalar_type(), "), got ",
                    t.numel(), " x ", t.scalar_type());
}

std::optional<DType> dtype_of(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return DType{2, 32};
    case at::kDouble: return DType{2, 64};
    case at::kHalf: return DType{2, 16};
    case at::kBFloat16: return DType{4, 16};
    case at::kChar: return DType{0, 8};
    case at::kShort: return DType{0, 16};
    case at::kInt: return DType{0, 32};
    case at::kLong: return DType{0, 64};
    case at::kByte: return DType{1, 8};
    case at::kUInt16: return DType{1, 16};
    case at::kUInt32: return DType{1, 32};
    case at::kUInt64: return DType{1, 64};
    case at::kBool: return DType{6, 8};
    case at::kComplexFloat: return DType{5, 64};  // DLPack kDLComplex
    case at::kComplexDouble: return DType{5, 128};
    default: return std::nullopt;
  }
}

// The engine's view of a (contiguous) tensor: its bytes, the allocation that
// holds them (registered once by the placed path) and that allocation kept
// alive while the engine may touch it. `source` (recv from any source) lives
// in the same keep-alive, so a dropped Work leaves the engine nothing dangling.
struct Keep {
  c10::Storage storage;
  int source = -1;
};

Buffer buffer_of(const at::Tensor& t, std::shared_ptr<Keep>* keep_out = nullptr) {
  Buffer b;
  b.data = t.numel() ? t.data_ptr() : nullptr;
  b.nbytes = t.nbytes();
  const c10::Storage& st = t.storage();
  b.base = st.nbytes() ? st.mutable_data() : nullptr;
  b.base_bytes = st.nbytes();
  auto keep = std::make_shared<Keep>(Keep{st});
  if (keep_out) *keep_out = keep;
  b.keep = std::move(keep);
  return b;
}

DType engine_dtype(const at::Tensor& t) { return *dtype_of(t.scalar_type()); }

// A tensor the engine needs contiguous: the tensor itself, or a contiguous
// copy (`copy_in`: with its values) written back by back().
struct Staged {
  at::Tensor orig, t;
  Staged(const at::Tensor& o, bool copy_in)
      : orig(o), t(o.is_contiguous() ? o : (copy_in ? o.contiguous() : at::empty(o.sizes(), o.options()))) {}
  void back() {
    if (!t.is_same(orig)) orig.copy_(t);
  }
};

at::Tensor flat_of(const at::Tensor& t) { return t.is_contiguous() ? t.view(-1) : t.contiguous().view(-1); }

// ---- reductions ----

struct Reduction {
  TwOp op = TwOp::kSum;
  double factor = 1.0;
  bool as_real = false;  // a complex sum: reduced as its real view (as torch's own view_as_real path)
};

const char* op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

// Checks that `rop` reduces `st` (as gloo does, plus AVG and PREMUL_SUM for
// floating and complex dtypes) and says how the engine does it.
Reduction reduction(const c10d::ReduceOp& rop, at::ScalarType st, const char* what) {
  const auto op = rop.op_;
  const char* name = op_name(op);
  TORCH_CHECK_VALUE(dtype_of(st).has_value(), "tensorwire backend: ", what, " does not reduce ", st);
  const bool is_bool = st == at::kBool;
  const bool is_complex = at::isComplexType(st);
  const bool is_float = at::isFloatingType(st);
  Reduction r;
  switch (op) {
    case c10d::ReduceOp::SUM:
      r.op = is_bool ? TwOp::kBor : TwOp::kSum;  // gloo: a bool sum is true if any is (an OR)
      r.as_real = is_complex;
      return r;
    case c10d::ReduceOp::PRODUCT: r.op = is_bool ? TwOp::kBand : TwOp::kProduct; return r;
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      TORCH_CHECK_VALUE(!is_complex, "tensorwire backend: ", what, " ReduceOp.", name, " is not supported for ", st);
      r.op = is_bool ? (op == c10d::ReduceOp::MIN ? TwOp::kBand : TwOp::kBor)
                     : (op == c10d::ReduceOp::MIN ? TwOp::kMin : TwOp::kMax);
      return r;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK_VALUE(!is_float && !is_complex, "tensorwire backend: ", what, " ReduceOp.", name,
                        " is not supported for ", st, " (it needs an integer or bool tensor)");
      r.op = op == c10d::ReduceOp::BAND ? TwOp::kBand : op == c10d::ReduceOp::BOR ? TwOp::kBor : TwOp::kBxor;
      return r;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_VALUE(is_float || is_complex, "tensorwire backend: ", what,
                        " ReduceOp.AVG needs a floating point tensor, got ", st);
      r.op = TwOp::kAvg;
      r.as_real = is_complex;
      return r;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_VALUE(is_float || is_complex, "tensorwire backend: ", what,
                        " ReduceOp.PREMUL_SUM needs a floating point tensor, got ", st);
      auto sup = c10::static_intrusive_pointer_cast<c10d::PreMulSumSupplement>(rop.supplement_);
      TORCH_CHECK_VALUE(sup, "tensorwire backend: ", what, " ReduceOp.PREMUL_SUM without its factor");
      r.factor = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
      r.op = TwOp::kPremulSum;
      r.as_real = is_complex;
      return r;
    }
    default: TORCH_CHECK_VALUE(false, "tensorwire backend: ", what, " ReduceOp.", name, " is not supported");
  }
}

// The engine's view of `t` for a reduction: a complex tensor as its floats where the op allows.
at::Tensor reducible(const at::Tensor& t, const Reduction& r) { return r.as_real ? at::view_as_real(t) : t; }

// One rank's reduction: only PREMUL_SUM changes anything.
void reduce_alone(at::Tensor& t, const Reduction& r) {
  if (r.op == TwOp::kPremulSum) t.mul_(r.factor);
}

void check_root(int64_t root, int size, const char* what) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "tensorwire backend: ", what, " root must be a rank in 0..", size - 1,
                    ", got ", root);
}

// all_to_all_single's blocks in bytes: offsets and lengths of `t` split along
// dimension 0 by `splits` rows (none: evenly).
void split_bytes(const at::Tensor& t, const std::vector<int64_t>& splits, int n, const char* side,
                 std::vector<std::size_t>& offsets, std::vector<std::size_t>& lengths) {
  const int64_t rows = t.dim() ? t.size(0) : 1;
  const int64_t row_bytes = rows ? static_cast<int64_t>(t.nbytes()) / rows : 0;
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    TORCH_CHECK_VALUE(rows % n == 0, "tensorwire backend: all_to_all_single without splits needs the ", side,
                      "'s dimension 0 (", rows, ") divisible by the group size ", n);
    s.assign(n, rows / n);
  }
  TORCH_CHECK_VALUE(static_cast<int>(s.size()) == n, "tensorwire backend: all_to_all_single needs ", n, " ", side,
                    " split sizes, got ", s.size());
  int64_t sum = 0;
  for (int64_t v : s) {
    TORCH_CHECK_VALUE(v >= 0, "tensorwire backend: all_to_all_single ", side, " split sizes must be >= 0");
    sum += v;
  }
  TORCH_CHECK_VALUE(sum == rows, "tensorwire backend: all_to_all_single ", side, " split sizes add up to ", sum,
                    ", not to its dimension 0 (", rows, ")");
  offsets.assign(n, 0);
  lengths.assign(n, 0);
  std::size_t off = 0;
  for (int p = 0; p < n; ++p) {
    offsets[p] = off;
    lengths[p] = static_cast<std::size_t>(s[p] * row_bytes);
    off += lengths[p];
  }
}

// Packs tensors into one byte tensor, each block at a 16-byte aligned offset
// (so that a block read back can be viewed as any dtype).
std::size_t aligned(std::size_t n) { return (n + 15) & ~std::size_t(15); }

}  // namespace

// ============================== Work =====================================

WorkTensorwire::WorkTensorwire(ProcessGroupTensorwire* pg, OpType type, const char* what,
                               std::vector<at::Tensor> outputs, double timeout_s, uint64_t seq)
    : c10d::Work(pg->getRank(), type),
      pg_(pg),
      pg_rank_(pg->getRank()),
      what_(what),
      outputs_(std::move(outputs)),
      timeout_s_(timeout_s),
      seq_(seq) {}

WorkTensorwire::~WorkTensorwire() = default;

void WorkTensorwire::complete(std::exception_ptr error) {
  if (done_.exchange(true)) return;
  if (!error && after_) {
    try {
      after_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_ = true;
    exception_ = error;
    fut = future_;
  }
  cv_.notify_all();
  keep_.clear();
  if (fut) {  // outside every lock: its callbacks run here (DDP's comm hooks)
    if (error) {
      fut->setError(error);
    } else {
      fut->markCompleted(c10::IValue(outputs_));
    }
  }
}

void WorkTensorwire::complete_from_request() {
  const int state = request_.state();
  if (state == 0) return;
  if (state == 1) {
    complete(nullptr);
    return;
  }
  std::string msg = "tensorwire backend, rank " + std::to_string(pg_rank_) + ": " + what_;
  if (peer_ >= 0) msg += (opType_ == OpType::SEND ? " to rank " : " from rank ") + std::to_string(peer_);
  msg += " failed: " + request_.error_message();
  const int failed = request_.failed_rank();
  if (failed >= 0 && msg.find("rank " + std::to_string(failed) + " ") == std::string::npos) {
    msg += " (rank " + std::to_string(failed) + " failed)";
  }
  complete(backend_error(msg));
}

bool WorkTensorwire::isCompleted() {
  if (p2p_ && !done_.load() && request_.test()) complete_from_request();
  for (auto& child : children_) child->isCompleted();
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool WorkTensorwire::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr WorkTensorwire::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

int WorkTensorwire::sourceRank() const {
  TORCH_CHECK(opType_ == OpType::RECV || opType_ == OpType::RECVANYSOURCE,
              "tensorwire backend: sourceRank() is a receive's");
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(completed_, "tensorwire backend: sourceRank() before the receive completed (wait() first)");
  return source_;
}

std::vector<at::Tensor> WorkTensorwire::result() { return outputs_; }

bool WorkTensorwire::wait(std::chrono::milliseconds timeout) {
  const double seconds = timeout.count() > 0 ? timeout.count() / 1000.0 : timeout_s_;
  if (p2p_ && !done_.load()) {
    try {
      request_.wait(seconds);
    } catch (const std::exception&) {
      // a failure is read from the request below; a timeout leaves it pending
    }
    if (request_.state() == 0) {
      throw_backend_error("tensorwire backend, rank " + std::to_string(pg_rank_) + ": " + what_ +
                          (opType_ == OpType::SEND ? " to rank " : " from rank ") +
                          (peer_ >= 0 ? std::to_string(peer_) : std::string("any")) + " did not complete within " +
                          c10::str(seconds) + " s: Timed out waiting for it (it stays posted)");
    }
    complete_from_request();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  // A queued op runs within its own timeout; a wait without one waits for that.
  const bool bounded = timeout.count() > 0;
  if (bounded) {
    if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
      lock.unlock();
      throw_backend_error("tensorwire backend, rank " + std::to_string(pg_rank_) + ": " + what_ +
                          " did not complete within " + c10::str(seconds) +
                          " s: Timed out waiting for it (it runs on in the background)");
    }
  } else {
    cv_.wait(lock, [&] { return completed_; });
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkTensorwire::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  bool settle = false, hook = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      settle = completed_;
    }
    hook = p2p_ && !completed_ && !callback_set_;
    callback_set_ = callback_set_ || hook;
    fut = future_;
  }
  if (settle) {
    std::exception_ptr e = exception();
    if (e) {
      fut->setError(e);
    } else {
      fut->markCompleted(c10::IValue(outputs_));
    }
  }
  if (hook && request_.state() != 0) {
    complete_from_request();  // done already: no callback (the group may be gone by now)
  } else if (hook) {
    // The engine's callback must not block: the group's completion thread
    // finishes the Work (copy-back, future callbacks). The group outlives
    // it: closing the engine fails what is pending before the thread stops.
    auto self = c10::intrusive_ptr<WorkTensorwire>::reclaim_copy(this);
    ProcessGroupTensorwire* pg = pg_;
    request_.then([self, pg](bool, const std::string&) { pg->defer_completion(self); });
  }
  return fut;
}

// ============================ the group ==================================

namespace {
// Every live group, for quiesce_all() (interpreter exit).
std::mutex& groups_mu() {
  static auto* mu = new std::mutex;  // never destroyed: static destructors run after exit's last use
  return *mu;
}
std::set<ProcessGroupTensorwire*>& groups() {
  static auto* all = new std::set<ProcessGroupTensorwire*>;
  return *all;
}
}  // namespace

bool ProcessGroupTensorwire::quiesce_all(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(0.0, timeout_s));
  std::lock_guard<std::mutex> lock(groups_mu());  // a group's destructor waits here: none goes meanwhile
  bool idle = true;
  for (ProcessGroupTensorwire* g : groups()) {
    idle = g->quiesce(std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count()) && idle;
  }
  return idle;
}

ProcessGroupTensorwire::ProcessGroupTensorwire(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               std::chrono::milliseconds timeout, const std::string& group_id)
    : c10d::Backend(rank, size),
      timeout_s_(timeout.count() > 0 ? timeout.count() / 1000.0 : 1800.0),
      group_id_(group_id) {
  transport_ = env("TENSORWIRE_TRANSPORT", "auto");
  progress_ = progress_mode(transport_, size);
  if (size > 1) {
    try {
      DeviceConfig config;
      config.host = env("TENSORWIRE_HOST");
      if (config.host.empty()) config.host = local_host_towards(root_host(store));
      config.port = 0;
      config.transport = transport_;
      config.progress = progress_ == "inline" ? ProgressMode::kInline : ProgressMode::kBlocking;
      config.token = env("TENSORWIRE_TOKEN");
      device_ = std::make_unique<Device>(config);
      StoreRendezvous rendezvous(store);
      MessengerConfig mc;
      mc.timeout_s = timeout_s_.load();
      mc.name = "tensorwire/" + (group_id.empty() ? std::string("pg") : group_id);
      messenger_ = make_messenger(*device_, rank, size, rendezvous, mc);
      coll_ = std::make_unique<Collectives>(*messenger_);
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      coll_.reset();
      messenger_.reset();
      device_.reset();
      throw_backend_error("tensorwire backend, rank " + std::to_string(rank) + " of " + std::to_string(size) +
                          ": cannot set up the group: " + e.what());
    }
  }
  worker_ = std::thread([this] { run_worker(); });
  completer_ = std::thread([this] { run_completer(); });
  {
    std::lock_guard<std::mutex> lock(groups_mu());
    groups().insert(this);
  }
  init();
}

ProcessGroupTensorwire::~ProcessGroupTensorwire() {
  {
    std::lock_guard<std::mutex> lock(groups_mu());
    groups().erase(this);
  }
  close(false);
}

std::string ProcessGroupTensorwire::describe() const {
  std::ostringstream s;
  s << "tensorwire rank " << rank_ << "/" << size_ << " transport=" << transport_ << " progress=" << progress_;
  if (device_) s << " address=" << device_->address();
  return s.str();
}

std::vector<std::pair<std::string, uint64_t>> ProcessGroupTensorwire::stats() const {
  std::vector<std::pair<std::string, uint64_t>> out{{"sequence", seq_.load()}};
  if (messenger_) {
    MessengerStats m = messenger_->stats();
    out.emplace_back("eager_sends", m.eager_sends);
    out.emplace_back("placed_sends", m.placed_sends);
    out.emplace_back("unexpected", m.unexpected);
    out.emplace_back("shared_receives", m.shared_receives);
    out.emplace_back("stale_registrations", m.stale_registrations);
  }
  if (coll_) out.emplace_back("collective_calls", coll_->calls());
  return out;
}

double ProcessGroupTensorwire::op_timeout(std::chrono::milliseconds timeout) const {
  return timeout.count() > 0 ? timeout.count() / 1000.0 : timeout_s_.load();
}

void ProcessGroupTensorwire::setTimeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(timeout.count() > 0, "tensorwire backend: the group timeout must be positive");
  timeout_s_ = timeout.count() / 1000.0;
}

void ProcessGroupTensorwire::check_open(const char* what) const {
  if (closed_.load()) {
    throw_backend_error("tensorwire backend, rank " + std::to_string(rank_) + ": " + what +
                        " on a process group that was shut down");
  }
}

c10::intrusive_ptr<WorkTensorwire> ProcessGroupTensorwire::make_work(OpType type, const char* what,
                                                                     std::vector<at::Tensor> outputs,
                                                                     std::chrono::milliseconds timeout,
                                                                     bool collective) {
  uint64_t seq = collective ? ++seq_ : seq_.load();
  auto work = c10::make_intrusive<WorkTensorwire>(this, type, what, std::move(outputs), op_timeout(timeout), seq);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

std::exception_ptr ProcessGroupTensorwire::as_backend_error(const char* what, std::exception_ptr e) const {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error&) {
    return e;  // torch's own (a copy's error) or one of ours, already worded
  } catch (const tensorwire::Timeout& err) {
    // " Timed out " as gloo words it (PyTorch's suite matches it)
    return backend_error("tensorwire backend, rank " + std::to_string(rank_) + ": " + what + " failed: Timed out (" +
                         err.what() + ")");
  } catch (const std::exception& err) {
    return backend_error("tensorwire backend, rank " + std::to_string(rank_) + ": " + what + " failed: " + err.what());
  } catch (...) {
    return backend_error("tensorwire backend, rank " + std::to_string(rank_) + ": " + what + " failed");
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::enqueue(c10::intrusive_ptr<WorkTensorwire> work, Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      work->complete(backend_error("tensorwire backend, rank " + std::to_string(rank_) + ": " + work->what_ +
                                   " on a process group that was shut down"));
      return work;
    }
    queue_.emplace_back(work, std::move(job));
  }
  cv_.notify_all();
  return work;
}

void ProcessGroupTensorwire::run_worker() {
  for (;;) {
    std::pair<c10::intrusive_ptr<WorkTensorwire>, Job> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    std::exception_ptr error;
    if (closed_.load()) {
      error = backend_error("tensorwire backend, rank " + std::to_string(rank_) + ": " + item.first->what_ +
                            " did not run: the process group was shut down");
    } else {
      try {
        item.second();
      } catch (...) {
        error = as_backend_error(item.first->what_, std::current_exception());
      }
    }
    item.second = nullptr;  // drop the job's tensors before the Work completes
    item.first->complete(error);
    item.first.reset();  // idle holds nothing: quiesce() relies on it
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    idle_cv_.notify_all();
  }
}

void ProcessGroupTensorwire::defer_completion(c10::intrusive_ptr<WorkTensorwire> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    completions_.push_back(std::move(work));
  }
  cv_.notify_all();
}

void ProcessGroupTensorwire::run_completer() {
  for (;;) {
    c10::intrusive_ptr<WorkTensorwire> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return completer_stop_ || !completions_.empty(); });
      if (completions_.empty()) return;
      work = std::move(completions_.front());
      completions_.pop_front();
      completing_ = true;
    }
    work->complete_from_request();
    work.reset();
    {
      std::lock_guard<std::mutex> lock(mu_);
      completing_ = false;
    }
    idle_cv_.notify_all();
  }
}

void ProcessGroupTensorwire::close(bool graceful) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) return;
    if (graceful && std::this_thread::get_id() != worker_.get_id()) {
      // what was queued before runs first (bounded by the group timeout)
      idle_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_.load()),
                        [&] { return queue_.empty() && !running_; });
    }
    stopping_ = true;
  }
  closed_ = true;
  if (messenger_) {
    try {
      messenger_->close();  // fails what is pending: a running collective returns
    } catch (const std::exception&) {
    }
  }
  cv_.notify_all();
  if (worker_.joinable()) {
    if (std::this_thread::get_id() == worker_.get_id()) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    completer_stop_ = true;
  }
  cv_.notify_all();
  if (completer_.joinable()) {
    if (std::this_thread::get_id() == completer_.get_id()) {
      completer_.detach();
    } else {
      completer_.join();
    }
  }
  for (auto& work : coalesced_) work->complete(backend_error("tensorwire backend: the process group was shut down"));
  coalesced_.clear();
  coll_.reset();
  messenger_.reset();
  if (device_) {
    try {
      device_->close();
    } catch (const std::exception&) {
    }
    device_.reset();
  }
}

void ProcessGroupTensorwire::shutdown() { close(true); }

bool ProcessGroupTensorwire::quiesce(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_for(lock, std::chrono::duration<double>(std::max(0.0, timeout_s)), [&] {
    return (queue_.empty() && !running_ && completions_.empty() && !completing_) || stopping_;
  });
}

at::Tensor ProcessGroupTensorwire::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK_VALUE(device_ != nullptr, "tensorwire backend: allocateTensor needs a group of 2 or more ranks");
  TORCH_CHECK_VALUE(!options.has_device() || options.device().is_cpu(),
                    "tensorwire backend: allocateTensor makes CPU tensors, not ", options.device());
  TORCH_CHECK_VALUE(size >= 0, "tensorwire backend: allocateTensor of ", size, " elements");
  const auto dtype = options.has_dtype() ? c10::typeMetaToScalarType(options.dtype()) : at::kFloat;
  const std::size_t nbytes = std::max<std::size_t>(1, static_cast<std::size_t>(size) * c10::elementSize(dtype));
  auto block = std::make_shared<Block>(device_->allocate(nbytes, 64));
  void* data = block->data();
  // The Block (and its registered slab) lives as long as the tensor's storage.
  return at::from_blob(
      data, {static_cast<int64_t>(size)}, [block](void*) mutable { block.reset(); },
      options.dtype(dtype).device(at::kCPU));
}

void ProcessGroupTensorwire::abort() { close(false); }

// ---------------------------- collectives --------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::broadcast(std::vector<at::Tensor>& tensors,
                                                                 const c10d::BroadcastOptions& opts) {
  check_open("broadcast");
  check_root(opts.rootRank, size_, "broadcast");
  check_tensors(tensors, "broadcast");
  auto work = make_work(OpType::BROADCAST, "broadcast", tensors, opts.timeout, true);
  const int root = static_cast<int>(opts.rootRank);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, tensors, root, to] {
    if (size_ == 1) return;
    for (const auto& t : tensors) {
      if (t.numel() == 0) continue;
      Staged s(t, rank_ == root);
      coll_->broadcast(buffer_of(s.t), root, to);
      if (rank_ != root) s.back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::allreduce(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceOptions& opts) {
  // torch routes a sparse all_reduce on CPU here (its SparseCPU kernel is the CPU one), as to gloo
  for (const auto& t : tensors) {
    if (t.defined() && t.is_sparse()) return allreduce_sparse(tensors, opts);
  }
  check_open("all_reduce");
  check_tensors(tensors, "all_reduce");
  std::vector<Reduction> reds;
  for (const auto& t : tensors) reds.push_back(reduction(opts.reduceOp, t.scalar_type(), "all_reduce"));
  auto work = make_work(OpType::ALLREDUCE, "all_reduce", tensors, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, tensors, reds, to] {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].numel() == 0) continue;
      Staged s(tensors[i], true);
      at::Tensor x = reducible(s.t, reds[i]);
      if (size_ == 1) {
        reduce_alone(x, reds[i]);
      } else {
        coll_->allreduce(buffer_of(x), x.numel(), engine_dtype(x), reds[i].op, reds[i].factor, to);
      }
      s.back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                        const c10d::AllreduceOptions& opts) {
  const char* what = "all_reduce (sparse)";
  check_open(what);
  TORCH_CHECK_VALUE(!tensors.empty(), "tensorwire backend: ", what, " needs a tensor");
  const at::Tensor& first = tensors[0];
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(t.defined(), "tensorwire backend: ", what, " got an undefined tensor");
    TORCH_CHECK_VALUE(t.device().is_cpu(), "tensorwire backend: ", what, " takes CPU tensors, got one on ", t.device());
    TORCH_CHECK_VALUE(t.layout() == at::kSparse, "tensorwire backend: ", what,
                      " takes sparse COO tensors (all of one layout), got layout ", t.layout());
    TORCH_CHECK_VALUE(t.scalar_type() == first.scalar_type() && t.sizes() == first.sizes(),
                      "tensorwire backend: ", what, " needs its tensors of one size and dtype, got ",
                      first.scalar_type(), first.sizes(), " and ", t.scalar_type(), t.sizes());
  }
  TORCH_CHECK_VALUE(dtype_of(first.scalar_type()).has_value(), "tensorwire backend: ", what, " does not reduce ",
                    first.scalar_type());
  TORCH_CHECK_VALUE(opts.reduceOp.op_ == c10d::ReduceOp::SUM, "tensorwire backend: ", what,
                    " takes ReduceOp.SUM only (as gloo), got ReduceOp.", op_name(opts.reduceOp.op_));
  TORCH_CHECK_VALUE(first.dim() <= kSparseMaxDims, "tensorwire backend: ", what, " takes up to ", kSparseMaxDims,
                    " dimensions, got ", first.dim());
  auto work = make_work(OpType::_ALLREDUCE_SPARSE, "all_reduce (sparse)", tensors, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, tensors, to] {
    at::AutoDispatchBelowAutograd no_autograd;  // results land in the callers' tensors as plain data
    at::Tensor out = sparse_sum(tensors, to);
    for (const auto& t : tensors) t.copy_(out);
  });
}

// Every rank's sparse tensors summed, coalesced (gloo's result): each rank's
// layout (shape, dtype, nnz) gathered first, then its indices and values in
// one block (padded to the largest rank's), then summed here with ATen.
at::Tensor ProcessGroupTensorwire::sparse_sum(const std::vector<at::Tensor>& tensors, double to) {
  at::Tensor input = tensors[0];
  for (std::size_t i = 1; i < tensors.size(); ++i) input = input + tensors[i];
  input = input.coalesce();
  const int64_t sparse_dim = input.sparse_dim(), nnz = input._nnz();
  const at::ScalarType st = input.scalar_type();
  const auto sizes = input.sizes().vec();
  const auto value_shape = input.sizes().slice(sparse_dim);
  int64_t row = 1;  // elements of one value (a dense block of dense_dim dimensions)
  for (int64_t d : value_shape) row *= d;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(st));

  // 1. layouts: [sparse_dim, nnz, dtype, dim, sizes...], one row per rank
  constexpr int64_t kHead = 4;
  const int64_t width = kHead + kSparseMaxDims;
  at::Tensor mine = at::zeros({width}, at::kLong);
  int64_t* m = mine.data_ptr<int64_t>();
  m[0] = sparse_dim;
  m[1] = nnz;
  m[2] = static_cast<int64_t>(st);
  m[3] = static_cast<int64_t>(sizes.size());
  for (std::size_t d = 0; d < sizes.size(); ++d) m[kHead + d] = sizes[d];
  at::Tensor layouts = at::empty({size_, width}, at::kLong);
  if (size_ == 1) {
    layouts[0].copy_(mine);
  } else {
    coll_->allgather(buffer_of(mine), buffer_of(layouts), to);
  }
  auto describe = [&](int p) {
    const int64_t* q = layouts[p].data_ptr<int64_t>();
    std::ostringstream s;
    s << "rank " << p << ": ";
    if (q[2] >= 0 && q[2] < static_cast<int64_t>(at::ScalarType::NumOptions)) {
      s << "torch." << c10::getDtypeNames(static_cast<at::ScalarType>(q[2])).first;
    } else {
      s << "dtype " << q[2];
    }
    s << "[";
    for (int64_t d = 0; d < std::min<int64_t>(q[3], kSparseMaxDims); ++d) s << (d ? ", " : "") << q[kHead + d];
    s << "] with " << q[0] << " sparse dimension" << (q[0] == 1 ? "" : "s");
    return s.str();
  };
  std::vector<int64_t> block_of(size_);  // bytes of each rank's indices + values (indices aligned)
  int64_t block = 0;
  for (int p = 0; p < size_; ++p) {
    const int64_t* q = layouts[p].data_ptr<int64_t>();
    bool same = q[0] == m[0] && q[2] == m[2] && q[3] == m[3];
    for (int64_t d = 0; same && d < m[3]; ++d) same = q[kHead + d] == m[kHead + d];
    // Every rank reads the same table, so every rank refuses alike (and none gathers further).
    TORCH_CHECK_VALUE(same,
                      "tensorwire backend: all_reduce (sparse) needs one shape, dtype and sparse dimensions on "
                      "every rank; ",
                      describe(rank_), ", ", describe(p));
    TORCH_CHECK_VALUE(q[1] >= 0 && q[1] <= (int64_t(1) << 40), "tensorwire backend: all_reduce (sparse): rank ", p,
                      " reports ", q[1], " non-zero entries");
    block_of[p] = static_cast<int64_t>(aligned(q[1] * sparse_dim * 8)) + q[1] * row * elem;
    block = std::max(block, block_of[p]);
  }
  block = static_cast<int64_t>(aligned(block));

  // 2. indices and values, every rank's in one gather
  std::vector<at::Tensor> indices(size_), values(size_);
  auto value_sizes = [&](int64_t n) {
    std::vector<int64_t> v{n};
    v.insert(v.end(), value_shape.begin(), value_shape.end());
    return v;
  };
  if (block == 0) {  // nothing anywhere
    for (int p = 0; p < size_; ++p) {
      indices[p] = at::empty({sparse_dim, 0}, at::kLong);
      values[p] = at::empty(value_sizes(0), input.options().layout(at::kStrided));
    }
  } else {
    at::Tensor packed = at::zeros({block}, at::kByte);
    const int64_t ibytes = nnz * sparse_dim * 8, ioff = static_cast<int64_t>(aligned(ibytes));
    if (ibytes) packed.narrow(0, 0, ibytes).copy_(input._indices().contiguous().view(-1).view(at::kByte));
    if (nnz * row)
      packed.narrow(0, ioff, nnz * row * elem).copy_(input._values().contiguous().view(-1).view(at::kByte));
    at::Tensor gathered = at::empty({size_ * block}, at::kByte);
    if (size_ == 1) {
      gathered.copy_(packed);
    } else {
      coll_->allgather(buffer_of(packed), buffer_of(gathered), to);
    }
    for (int p = 0; p < size_; ++p) {
      const int64_t n = layouts[p].data_ptr<int64_t>()[1];
      const int64_t ib = n * sparse_dim * 8, off = p * block;
      indices[p] = gathered.narrow(0, off, ib).view(at::kLong).view({sparse_dim, n});
      values[p] =
          gathered.narrow(0, off + static_cast<int64_t>(aligned(ib)), n * row * elem).view(st).view(value_sizes(n));
    }
  }

  // 3. the sum, in rank order, coalesced (as gloo computes it)
  at::Tensor out = at::sparse_coo_tensor(indices[0], values[0], sizes, input.options());
  for (int p = 1; p < size_; ++p) out = out + at::sparse_coo_tensor(indices[p], values[p], sizes, input.options());
  return out.coalesce();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  check_open("all_reduce_coalesced");
  check_tensors(tensors, "all_reduce_coalesced");
  std::vector<Reduction> reds;
  for (const auto& t : tensors) reds.push_back(reduction(opts.reduceOp, t.scalar_type(), "all_reduce_coalesced"));
  auto work = make_work(OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, tensors, reds, to] {
    // One all_reduce per dtype, the tensors flattened together (every rank groups alike).
    std::vector<bool> done(tensors.size(), false);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (done[i]) continue;
      std::vector<std::size_t> group;
      std::vector<at::Tensor> flats;
      for (std::size_t j = i; j < tensors.size(); ++j) {
        if (!done[j] && tensors[j].scalar_type() == tensors[i].scalar_type()) {
          done[j] = true;
          group.push_back(j);
          flats.push_back(tensors[j].reshape(-1));
        }
      }
      at::Tensor flat = group.size() == 1 ? Staged(tensors[i], true).t.view(-1) : at::cat(flats);
      if (flat.numel() == 0) continue;
      at::Tensor x = reducible(flat, reds[i]);
      if (size_ == 1) {
        reduce_alone(x, reds[i]);
      } else {
        coll_->allreduce(buffer_of(x), x.numel(), engine_dtype(x), reds[i].op, reds[i].factor, to);
      }
      int64_t off = 0;
      for (std::size_t j : group) {
        const at::Tensor& t = tensors[j];
        at::Tensor part = flat.narrow(0, off, t.numel());
        if (part.data_ptr() != t.data_ptr() || !t.is_contiguous()) t.copy_(part.view(t.sizes()));
        off += t.numel();
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::reduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::ReduceOptions& opts) {
  check_open("reduce");
  check_root(opts.rootRank, size_, "reduce");
  check_tensors(tensors, "reduce");
  std::vector<Reduction> reds;
  for (const auto& t : tensors) reds.push_back(reduction(opts.reduceOp, t.scalar_type(), "reduce"));
  auto work = make_work(OpType::REDUCE, "reduce", tensors, opts.timeout, true);
  const int root = static_cast<int>(opts.rootRank);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, tensors, reds, root, to] {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].numel() == 0) continue;
      // A non-root rank's tensor is left as it was (gloo's): the engine gets a copy.
      Staged s(tensors[i], true);
      at::Tensor x = reducible(s.t, reds[i]);
      if (size_ == 1) {
        reduce_alone(x, reds[i]);
      } else {
        coll_->reduce(buffer_of(x), x.numel(), engine_dtype(x), reds[i].op, root, reds[i].factor, to);
      }
      if (rank_ == root) s.back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) {
  check_open("all_gather");
  check_tensors(inputs, "all_gather");
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(),
                    "tensorwire backend: all_gather needs one output list per input, got ", outputs.size(),
                    " lists for ", inputs.size(), " inputs");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK_VALUE(static_cast<int>(outputs[i].size()) == size_, "tensorwire backend: all_gather needs ", size_,
                      " output tensors per input, got ", outputs[i].size());
    for (const auto& o : outputs[i]) check_like(o, inputs[i], "all_gather");
  }
  std::vector<at::Tensor> outs;
  for (const auto& list : outputs) outs.insert(outs.end(), list.begin(), list.end());
  auto work = make_work(OpType::ALLGATHER, "all_gather", outs, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, outputs, inputs, to] {
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const int64_t count = inputs[i].numel();
      if (count == 0) continue;
      at::Tensor in = flat_of(inputs[i]);
      at::Tensor gathered = at::empty({size_ * count}, in.options());
      if (size_ == 1) {
        gathered.copy_(in);
      } else {
        coll_->allgather(buffer_of(in), buffer_of(gathered), to);
      }
      for (int p = 0; p < size_; ++p) {
        outputs[i][p].copy_(gathered.narrow(0, p * count, count).view(outputs[i][p].sizes()));
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                       const c10d::AllgatherOptions& opts) {
  check_open("all_gather_into_tensor");
  check_tensor(input, "all_gather_into_tensor");
  check_tensor(output, "all_gather_into_tensor");
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type() && output.numel() == size_ * input.numel(),
                    "tensorwire backend: all_gather_into_tensor needs an output of ", size_, " x the input (", size_,
                    " x ", input.numel(), " ", input.scalar_type(), "), got ", output.numel(), " ",
                    output.scalar_type());
  auto work = make_work(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {output}, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, output, input, to] {
    if (input.numel() == 0) return;
    Staged out(output, false);
    at::Tensor in = flat_of(input);
    if (size_ == 1) {
      out.t.view(-1).copy_(in);
    } else {
      coll_->allgather(buffer_of(in), buffer_of(out.t), to);
    }
    out.back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // gloo's form: one output list per rank, each holding one tensor per input.
  check_open("all_gather_coalesced");
  check_tensors(inputs, "all_gather_coalesced");
  TORCH_CHECK_VALUE(static_cast<int>(output_lists.size()) == size_, "tensorwire backend: all_gather_coalesced needs ",
                    size_, " output lists (one per rank), got ", output_lists.size());
  for (const auto& list : output_lists) {
    TORCH_CHECK_VALUE(list.size() == inputs.size(), "tensorwire backend: all_gather_coalesced needs ", inputs.size(),
                      " tensors in each output list (one per input), got ", list.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) check_like(list[i], inputs[i], "all_gather_coalesced");
  }
  std::vector<at::Tensor> outs;
  for (const auto& list : output_lists) outs.insert(outs.end(), list.begin(), list.end());
  auto work = make_work(OpType::ALLGATHER_COALESCED, "all_gather_coalesced", outs, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, output_lists, inputs, to] {
    // Every input's bytes in one block (each at an aligned offset), gathered once.
    std::vector<std::size_t> offs;
    std::size_t block = 0;
    for (const auto& t : inputs) {
      offs.push_back(block);
      block += aligned(t.nbytes());
    }
    if (block == 0) return;
    at::Tensor packed = at::zeros({static_cast<int64_t>(block)}, at::kByte);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].numel() == 0) continue;
      packed.narrow(0, offs[i], inputs[i].nbytes()).copy_(flat_of(inputs[i]).view(at::kByte));
    }
    at::Tensor gathered = at::empty({static_cast<int64_t>(block) * size_}, at::kByte);
    if (size_ == 1) {
      gathered.copy_(packed);
    } else {
      coll_->allgather(buffer_of(packed), buffer_of(gathered), to);
    }
    for (int p = 0; p < size_; ++p) {
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& o = output_lists[p][i];
        if (o.numel() == 0) continue;
        at::Tensor bytes = gathered.narrow(0, p * block + offs[i], o.nbytes());
        o.copy_(bytes.view(o.scalar_type()).view(o.sizes()));
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  check_open("all_gather_into_tensor_coalesced");
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(),
                    "tensorwire backend: all_gather_into_tensor_coalesced needs one "
                    "output per input");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], "all_gather_into_tensor_coalesced");
    check_tensor(outputs[i], "all_gather_into_tensor_coalesced");
    TORCH_CHECK_VALUE(
        outputs[i].scalar_type() == inputs[i].scalar_type() && outputs[i].numel() == size_ * inputs[i].numel(),
        "tensorwire backend: all_gather_into_tensor_coalesced needs outputs of ", size_, " x their input");
  }
  auto work = make_work(OpType::COALESCED, "all_gather_into_tensor_coalesced", outputs, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, outputs, inputs, to] {
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].numel() == 0) continue;
      Staged out(outputs[i], false);
      at::Tensor in = flat_of(inputs[i]);
      if (size_ == 1) {
        out.t.view(-1).copy_(in);
      } else {
        coll_->allgather(buffer_of(in), buffer_of(out.t), to);
      }
      out.back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::GatherOptions& opts) {
  check_open("gather");
  check_root(opts.rootRank, size_, "gather");
  TORCH_CHECK_VALUE(inputs.size() == 1, "tensorwire backend: gather takes one input tensor, got ", inputs.size());
  check_tensor(inputs[0], "gather");
  const int root = static_cast<int>(opts.rootRank);
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                      "tensorwire backend: gather on the root needs one list of ", size_, " output tensors");
    for (const auto& o : outputs[0]) check_like(o, inputs[0], "gather");
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                      "tensorwire backend: gather takes no output tensors on a rank that is not the root");
  }
  std::vector<at::Tensor> outs = rank_ == root ? outputs[0] : std::vector<at::Tensor>{};
  auto work = make_work(OpType::GATHER, "gather", outs, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  at::Tensor input = inputs[0];
  return enqueue(work, [this, outs, input, root, to] {
    const int64_t count = input.numel();
    if (count == 0) return;
    at::Tensor in = flat_of(input);
    at::Tensor gathered = rank_ == root ? at::empty({size_ * count}, in.options()) : at::Tensor();
    if (size_ == 1) {
      gathered.copy_(in);
    } else {
      coll_->gather(buffer_of(in), gathered.defined() ? buffer_of(gathered) : Buffer{}, root, to);
    }
    if (rank_ == root) {
      for (int p = 0; p < size_; ++p) outs[p].copy_(gathered.narrow(0, p * count, count).view(outs[p].sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ScatterOptions& opts) {
  check_open("scatter");
  check_root(opts.rootRank, size_, "scatter");
  TORCH_CHECK_VALUE(outputs.size() == 1, "tensorwire backend: scatter takes one output tensor, got ", outputs.size());
  check_tensor(outputs[0], "scatter");
  const int root = static_cast<int>(opts.rootRank);
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                      "tensorwire backend: scatter on the root needs one list of ", size_, " input tensors");
    for (const auto& i : inputs[0]) check_like(i, outputs[0], "scatter");
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                      "tensorwire backend: scatter takes no input tensors on a rank that is not the root");
  }
  std::vector<at::Tensor> ins = rank_ == root ? inputs[0] : std::vector<at::Tensor>{};
  auto work = make_work(OpType::SCATTER, "scatter", outputs, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  at::Tensor output = outputs[0];
  return enqueue(work, [this, ins, output, root, to] {
    if (output.numel() == 0) return;
    Staged out(output, false);
    at::Tensor packed;
    if (rank_ == root) {
      std::vector<at::Tensor> flats;
      for (const auto& t : ins) flats.push_back(t.reshape(-1));
      packed = at::cat(flats);
    }
    if (size_ == 1) {
      out.t.view(-1).copy_(packed);
    } else {
      coll_->scatter(packed.defined() ? buffer_of(packed) : Buffer{}, buffer_of(out.t), root, to);
    }
    out.back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                      std::vector<std::vector<at::Tensor>>& inputs,
                                                                      const c10d::ReduceScatterOptions& opts) {
  check_open("reduce_scatter");
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(),
                    "tensorwire backend: reduce_scatter needs one input list per output");
  std::vector<Reduction> reds;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    check_tensor(outputs[i], "reduce_scatter");
    TORCH_CHECK_VALUE(static_cast<int>(inputs[i].size()) == size_, "tensorwire backend: reduce_scatter needs ", size_,
                      " input tensors per output, got ", inputs[i].size());
    for (const auto& t : inputs[i]) check_like(t, outputs[i], "reduce_scatter");
    reds.push_back(reduction(opts.reduceOp, outputs[i].scalar_type(), "reduce_scatter"));
  }
  auto work = make_work(OpType::REDUCE_SCATTER, "reduce_scatter", outputs, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, outputs, inputs, reds, to] {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].numel() == 0) continue;
      std::vector<at::Tensor> flats;
      for (const auto& t : inputs[i]) flats.push_back(t.reshape(-1));
      at::Tensor packed = at::cat(flats);
      Staged out(outputs[i], false);
      at::Tensor in = reducible(packed, reds[i]), o = reducible(out.t, reds[i]);
      if (size_ == 1) {
        o.view(-1).copy_(in.view(-1));
        reduce_alone(o, reds[i]);
      } else {
        coll_->reduce_scatter(buffer_of(in), buffer_of(o), o.numel(), engine_dtype(o), reds[i].op, reds[i].factor, to);
      }
      out.back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                            const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return reduce_scatter_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* what = outputs.size() == 1 ? "reduce_scatter_tensor" : "reduce_scatter_tensor_coalesced";
  check_open(what);
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "tensorwire backend: ", what, " needs one input per output");
  std::vector<Reduction> reds;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    check_tensor(outputs[i], what);
    check_tensor(inputs[i], what);
    TORCH_CHECK_VALUE(
        inputs[i].scalar_type() == outputs[i].scalar_type() && inputs[i].numel() == size_ * outputs[i].numel(),
        "tensorwire backend: ", what, " needs an input of ", size_, " x the output (", size_, " x ", outputs[i].numel(),
        " ", outputs[i].scalar_type(), "), got ", inputs[i].numel(), " ", inputs[i].scalar_type());
    reds.push_back(reduction(opts.reduceOp, outputs[i].scalar_type(), what));
  }
  auto work = make_work(outputs.size() == 1 ? OpType::_REDUCE_SCATTER_BASE : OpType::COALESCED, what, outputs,
                        opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, outputs, inputs, reds, to] {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].numel() == 0) continue;
      Staged out(outputs[i], false);
      at::Tensor in = reducible(flat_of(inputs[i]), reds[i]), o = reducible(out.t, reds[i]);
      if (size_ == 1) {
        o.view(-1).copy_(in.view(-1));
        reduce_alone(o, reds[i]);
      } else {
        coll_->reduce_scatter(buffer_of(in), buffer_of(o), o.numel(), engine_dtype(o), reds[i].op, reds[i].factor, to);
      }
      out.back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                     std::vector<int64_t>& output_splits,
                                                                     std::vector<int64_t>& input_splits,
                                                                     const c10d::AllToAllOptions& opts) {
  check_open("all_to_all_single");
  check_tensor(input, "all_to_all_single");
  check_tensor(output, "all_to_all_single");
  TORCH_CHECK_VALUE(input.scalar_type() == output.scalar_type(),
                    "tensorwire backend: all_to_all_single needs one dtype, got ", input.scalar_type(), " and ",
                    output.scalar_type());
  std::vector<std::size_t> send_off, send_len, recv_off, recv_len;
  split_bytes(input, input_splits, size_, "input", send_off, send_len);
  split_bytes(output, output_splits, size_, "output", recv_off, recv_len);
  TORCH_CHECK_VALUE(send_len[rank_] == recv_len[rank_], "tensorwire backend: all_to_all_single: rank ", rank_,
                    " sends itself ", send_len[rank_], " B but expects ", recv_len[rank_], " B");
  auto work = make_work(OpType::ALLTOALL_BASE, "all_to_all_single", {output}, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, output, input, send_off, send_len, recv_off, recv_len, to] {
    Staged out(output, false);
    at::Tensor in = input.is_contiguous() ? input : input.contiguous();
    if (size_ == 1) {
      if (in.numel()) out.t.view(-1).copy_(in.view(-1));
    } else {
      coll_->alltoall(buffer_of(in), send_off, send_len, buffer_of(out.t), recv_off, recv_len, to);
    }
    out.back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::alltoall(std::vector<at::Tensor>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllToAllOptions& opts) {
  check_open("all_to_all");
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
                    "tensorwire backend: all_to_all needs ", size_, " input and ", size_, " output tensors, got ",
                    inputs.size(), " and ", outputs.size());
  check_tensors(inputs, "all_to_all");
  check_tensors(outputs, "all_to_all");
  TORCH_CHECK_VALUE(inputs[rank_].nbytes() == outputs[rank_].nbytes(), "tensorwire backend: all_to_all: rank ", rank_,
                    " sends itself ", inputs[rank_].nbytes(), " B but expects ", outputs[rank_].nbytes(), " B");
  auto work = make_work(OpType::ALLTOALL, "all_to_all", outputs, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  return enqueue(work, [this, outputs, inputs, to] {
    std::vector<std::size_t> send_off, send_len, recv_off, recv_len;
    std::size_t in_bytes = 0, out_bytes = 0;
    for (int p = 0; p < size_; ++p) {
      send_off.push_back(in_bytes);
      send_len.push_back(inputs[p].nbytes());
      in_bytes += aligned(inputs[p].nbytes());
      recv_off.push_back(out_bytes);
      recv_len.push_back(outputs[p].nbytes());
      out_bytes += aligned(outputs[p].nbytes());
    }
    at::Tensor packed = at::empty({static_cast<int64_t>(in_bytes)}, at::kByte);
    at::Tensor got = at::empty({static_cast<int64_t>(out_bytes)}, at::kByte);
    for (int p = 0; p < size_; ++p) {
      if (inputs[p].numel()) packed.narrow(0, send_off[p], send_len[p]).copy_(flat_of(inputs[p]).view(at::kByte));
    }
    if (size_ == 1) {
      got.narrow(0, 0, recv_len[0]).copy_(packed.narrow(0, 0, send_len[0]));
    } else {
      coll_->alltoall(buffer_of(packed), send_off, send_len, buffer_of(got), recv_off, recv_len, to);
    }
    for (int p = 0; p < size_; ++p) {
      const at::Tensor& o = outputs[p];
      if (o.numel()) o.copy_(got.narrow(0, recv_off[p], recv_len[p]).view(o.scalar_type()).view(o.sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::barrier(const c10d::BarrierOptions& opts) {
  check_open("barrier");
  auto work = make_work(OpType::BARRIER, "barrier", {}, opts.timeout, true);
  const double to = op_timeout(opts.timeout);
  // Queued behind every collective before it: it returns once they ran (gloo's).
  return enqueue(work, [this, to] {
    if (size_ > 1) coll_->barrier(to);
  });
}

void ProcessGroupTensorwire::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  check_open("monitored_barrier");
  // An explicit timeout of 0 means none left (gloo's), not the group's.
  const double to = opts.timeout.count() >= 0 ? opts.timeout.count() / 1000.0 : timeout_s_.load();
  auto work = make_work(OpType::BARRIER, "monitored_barrier", {}, opts.timeout, false);
  enqueue(work, [this, to, wait_all_ranks] {
    if (size_ == 1) return;
    const std::int64_t tag = kMonitorTag + static_cast<std::int64_t>(monitor_round_++);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(to);
    auto left = [&] {
      return std::max(0.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
    };
    const std::string ms = std::to_string(static_cast<int64_t>(to * 1000));
    if (to <= 0) {
      throw_backend_error("tensorwire backend: Rank " + std::to_string(rank_) +
                          " timed out in monitoredBarrier after " + ms + " ms");
    }
    if (rank_ == 0) {
      // Rank 0 hears from every rank within the timeout, then lets them go.
      std::vector<at::Tensor> bufs;
      std::vector<Request> reqs;
      for (int p = 1; p < size_; ++p) {
        bufs.push_back(at::zeros({1}, at::kByte));
        reqs.push_back(messenger_->irecv(buffer_of(bufs.back()), p, tag));
      }
      std::vector<int> failed;
      for (int p = 1; p < size_; ++p) {
        try {
          reqs[p - 1].wait(left());
          if (reqs[p - 1].state() != 1) throw std::runtime_error("pending");
        } catch (const std::exception&) {
          failed.push_back(p);
          if (!wait_all_ranks) break;
        }
      }
      if (!failed.empty()) {
        std::string names;
        for (int p : failed) names += (names.empty() ? "" : ", ") + std::to_string(p);
        throw_backend_error("tensorwire backend: " + std::string(failed.size() > 1 ? "Ranks " : "Rank ") + names +
                            " failed to pass monitoredBarrier in " + ms + " ms");
      }
      at::Tensor ack = at::zeros({1}, at::kByte);
      std::vector<Request> acks;
      for (int p = 1; p < size_; ++p) acks.push_back(messenger_->isend(buffer_of(ack), p, tag));
      for (auto& a : acks) a.wait(left());
    } else {
      at::Tensor one = at::zeros({1}, at::kByte), ack = at::zeros({1}, at::kByte);
      Request sent = messenger_->isend(buffer_of(one), 0, tag);
      Request got = messenger_->irecv(buffer_of(ack), 0, tag);
      try {
        got.wait(left());
        if (got.state() != 1) throw tensorwire::Timeout("no answer");
      } catch (const std::exception& e) {
        throw_backend_error("tensorwire backend: Rank " + std::to_string(rank_) +
                            " successfully reached monitoredBarrier, but received errors while waiting for "
                            "send/recv from rank 0 (within " +
                            ms + " ms: " + e.what() + ")");
      }
    }
  });
  work->wait(kNoTimeout);
}

void ProcessGroupTensorwire::startCoalescing() {
  TORCH_CHECK_VALUE(!coalescing_, "tensorwire backend: startCoalescing twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::endCoalescing() {
  TORCH_CHECK_VALUE(coalescing_, "tensorwire backend: endCoalescing without startCoalescing");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<WorkTensorwire>> ops;
  ops.swap(coalesced_);
  std::vector<at::Tensor> outs;
  for (const auto& w : ops) outs.insert(outs.end(), w->outputs_.begin(), w->outputs_.end());
  auto work = make_work(OpType::COALESCED, "coalesced ops", outs, c10d::kUnsetTimeout, false);
  work->children_ = ops;
  // Queued after the collectives it covers; the p2p ops it covers complete on their own.
  return enqueue(work, [ops] {
    for (const auto& w : ops) w->wait(std::chrono::milliseconds(static_cast<int64_t>(w->timeout_s_ * 1000)));
  });
}

// ------------------------------ p2p --------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::post_p2p(bool is_send, at::Tensor& t, int peer, int tag,
                                                                bool any_source) {
  const char* what = is_send ? "send" : any_source ? "recv from any source" : "recv";
  check_open(what);
  check_tensor(t, what);
  TORCH_CHECK_VALUE(size_ > 1, "tensorwire backend: ", what, " needs a group of 2 or more ranks");
  if (!any_source) {
    TORCH_CHECK_VALUE(peer >= 0 && peer < size_ && peer != rank_, "tensorwire backend: ", what,
                      " peer must be another rank of the group (0..", size_ - 1, ", not ", rank_, "), got ", peer);
  }
  TORCH_CHECK_VALUE(tag >= 0, "tensorwire backend: ", what, " tag must be >= 0, got ", tag);
  auto work =
      make_work(is_send      ? OpType::SEND
                : any_source ? OpType::RECVANYSOURCE
                             : OpType::RECV,
                what, is_send ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{t}, c10d::kUnsetTimeout, false);
  work->p2p_ = true;
  work->peer_ = any_source ? -1 : peer;
  at::Tensor buf = t;
  if (!t.is_contiguous()) {  // sent from, or received into, a contiguous copy
    buf = is_send ? t.contiguous() : at::empty(t.sizes(), t.options());
    if (!is_send) work->after_ = [t, buf]() mutable { t.copy_(buf); };
  }
  std::shared_ptr<Keep> keep;
  Buffer b = buffer_of(buf, &keep);
  try {
    if (is_send) {
      work->request_ = messenger_->isend(b, peer, tag);
    } else {
      work->request_ = messenger_->irecv(b, any_source ? kAnySource : peer, tag, &keep->source);
      if (!any_source) work->source_ = peer;
    }
  } catch (const tensorwire::InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, "tensorwire backend: ", what, ": ", e.what());
  } catch (const std::exception& e) {
    throw_backend_error("tensorwire backend, rank " + std::to_string(rank_) + ": " + what + " failed: " + e.what());
  }
  if (any_source) {
    // The engine writes the sender's rank into `keep` before the request completes.
    auto prev = std::move(work->after_);
    work->after_ = [w = work.get(), keep, prev]() {
      w->source_ = keep->source;
      if (prev) prev();
    };
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "tensorwire backend: send takes one tensor per call, got ", tensors.size());
  return post_p2p(true, tensors[0], dst, tag, false);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "tensorwire backend: recv takes one tensor per call, got ", tensors.size());
  return post_p2p(false, tensors[0], src, tag, false);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorwire::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "tensorwire backend: recv takes one tensor per call, got ", tensors.size());
  return post_p2p(false, tensors[0], -1, tag, true);
}

}  // namespace tensorwire::torch_backend
