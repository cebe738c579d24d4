// Copyright tensorwire authors.
#include "cuda/driver.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "tensorwire/error.h"

namespace tensorwire::cuda {

namespace {

// The driver API's types and constants, as cuda.h defines them (ABI-stable).
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
constexpr CUresult kSuccess = 0;
constexpr CUresult kOutOfMemory = 2;
constexpr int kAttrMemoryType = 2, kAttrIsManaged = 8, kAttrDeviceOrdinal = 9, kAttrRangeStart = 11,
              kAttrRangeSize = 12;
constexpr unsigned kMemoryTypeDevice = 2;
constexpr int kMaxDevices = 64;

struct Api {
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, std::size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, std::size_t) = nullptr;
  CUresult (*cuMemcpy)(CUdeviceptr, CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuPointerGetAttributes)(unsigned, int*, void**, CUdeviceptr) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
};

struct Driver {
  Api api;
  bool ok = false;
  std::string why;
  int devices = 0;
  std::mutex mu;
  CUcontext primary[kMaxDevices] = {};
};

template <typename F>
bool bind(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(::dlsym(lib, name));
  return *out != nullptr;
}

Driver& driver() {
  static Driver* d = [] {
    auto* d = new Driver();  // never destroyed: GPU memory may be freed during static destruction
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d->why = "libcuda.so.1 not found (no NVIDIA driver)";
      return d;
    }
    Api& a = d->api;
    const bool all =
        bind(lib, "cuInit", &a.cuInit) && bind(lib, "cuDeviceGetCount", &a.cuDeviceGetCount) &&
        bind(lib, "cuDeviceGet", &a.cuDeviceGet) && bind(lib, "cuDeviceGetName", &a.cuDeviceGetName) &&
        bind(lib, "cuDriverGetVersion", &a.cuDriverGetVersion) &&
        bind(lib, "cuDevicePrimaryCtxRetain", &a.cuDevicePrimaryCtxRetain) &&
        bind(lib, "cuCtxGetCurrent", &a.cuCtxGetCurrent) && bind(lib, "cuCtxSetCurrent", &a.cuCtxSetCurrent) &&
        bind(lib, "cuCtxPushCurrent_v2", &a.cuCtxPushCurrent) && bind(lib, "cuCtxPopCurrent_v2", &a.cuCtxPopCurrent) &&
        bind(lib, "cuCtxSynchronize", &a.cuCtxSynchronize) && bind(lib, "cuMemAlloc_v2", &a.cuMemAlloc) &&
        bind(lib, "cuMemFree_v2", &a.cuMemFree) && bind(lib, "cuMemsetD8_v2", &a.cuMemsetD8) &&
        bind(lib, "cuMemcpy", &a.cuMemcpy) && bind(lib, "cuPointerGetAttributes", &a.cuPointerGetAttributes) &&
        bind(lib, "cuGetErrorString", &a.cuGetErrorString);
    if (!all) {
      d->why = "libcuda.so.1 lacks a driver API entry point the core needs";
      return d;
    }
    if (CUresult r = a.cuInit(0); r != kSuccess) {
      d->why = "cuInit failed (error " + std::to_string(r) + ")";
      return d;
    }
    if (a.cuDeviceGetCount(&d->devices) != kSuccess || d->devices <= 0) {
      d->why = "the driver sees no GPU";
      d->devices = 0;
      return d;
    }
    if (d->devices > kMaxDevices) d->devices = kMaxDevices;
    d->ok = true;
    return d;
  }();
  return *d;
}

std::atomic<bool> g_in_use{false};
std::atomic<int> g_first{-1};

std::string error_text(CUresult r) {
  const char* s = nullptr;
  if (driver().api.cuGetErrorString && driver().api.cuGetErrorString(r, &s) == kSuccess && s) return s;
  return "CUDA error " + std::to_string(r);
}

void check(CUresult r, const std::string& what) {
  if (r == kSuccess) return;
  if (r == kOutOfMemory) throw PoolExhausted(what + ": " + error_text(r));
  throw Error(ErrorKind::kInvalidArgument, what + ": " + error_text(r));
}

Driver& ready() {
  Driver& d = driver();
  if (!d.ok) throw InvalidArgument("GPU memory needs CUDA: " + d.why);
  return d;
}

// The process now holds GPU memory through the core (in_use(), first_ordinal()).
void note_use(int ordinal) {
  int unset = -1;
  g_first.compare_exchange_strong(unset, ordinal);
  g_in_use.store(true, std::memory_order_release);
}

CUcontext primary_context(int ordinal) {
  Driver& d = ready();
  if (ordinal < 0 || ordinal >= d.devices) {
    throw InvalidArgument("no GPU " + std::to_string(ordinal) + ": this machine has " + std::to_string(d.devices));
  }
  std::lock_guard<std::mutex> lock(d.mu);
  if (!d.primary[ordinal]) {
    CUdevice dev = 0;
    check(d.api.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    check(d.api.cuDevicePrimaryCtxRetain(&d.primary[ordinal], dev), "cuDevicePrimaryCtxRetain");
  }
  note_use(ordinal);
  return d.primary[ordinal];
}

// `ordinal`'s primary context made current for a scope (restored after).
class Scope {
 public:
  explicit Scope(int ordinal) { check(driver().api.cuCtxPushCurrent(primary_context(ordinal)), "cuCtxPushCurrent"); }
  ~Scope() {
    CUcontext c = nullptr;
    driver().api.cuCtxPopCurrent(&c);
  }
};

}  // namespace

bool available() { return driver().ok; }
std::string unavailable_reason() { return driver().ok ? std::string() : driver().why; }
int device_count() { return driver().ok ? driver().devices : 0; }

std::string device_name(int ordinal) {
  Driver& d = ready();
  CUdevice dev = 0;
  char name[256] = {0};
  check(d.api.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  check(d.api.cuDeviceGetName(name, sizeof(name) - 1, dev), "cuDeviceGetName");
  return name;
}

int driver_version() {
  int v = 0;
  if (driver().ok) driver().api.cuDriverGetVersion(&v);
  return v;
}

bool in_use() { return g_in_use.load(std::memory_order_acquire); }
int first_ordinal() { return g_first.load(std::memory_order_acquire); }

PointerInfo query(const void* p) {
  PointerInfo info;
  Driver& d = driver();
  if (!d.ok || p == nullptr) return info;
  unsigned memory_type = 0, managed = 0;
  int ordinal = -1;
  CUdeviceptr start = 0;
  std::size_t size = 0;
  int attrs[] = {kAttrMemoryType, kAttrIsManaged, kAttrDeviceOrdinal, kAttrRangeStart, kAttrRangeSize};
  void* data[] = {&memory_type, &managed, &ordinal, &start, &size};
  // Host pointers are not an error: they report memory type 0.
  if (d.api.cuPointerGetAttributes(5, attrs, data, reinterpret_cast<CUdeviceptr>(p)) != kSuccess) return info;
  if (memory_type != kMemoryTypeDevice || managed) return info;
  info.device = true;
  info.ordinal = ordinal;
  info.base = static_cast<std::uintptr_t>(start);
  info.size = size;
  return info;
}

void* allocate(int ordinal, std::size_t nbytes) {
  Scope scope(ordinal);
  CUdeviceptr p = 0;
  check(driver().api.cuMemAlloc(&p, nbytes),
        "cannot allocate " + std::to_string(nbytes) + " bytes on GPU " + std::to_string(ordinal));
  return reinterpret_cast<void*>(p);
}

void release(int ordinal, void* p) noexcept {
  if (!p || !driver().ok) return;
  try {
    Scope scope(ordinal);
    driver().api.cuMemFree(reinterpret_cast<CUdeviceptr>(p));
  } catch (const Error&) {
    // The context is gone (process teardown): the memory went with it.
  }
}

void zero(int ordinal, void* p, std::size_t nbytes) {
  Scope scope(ordinal);
  check(driver().api.cuMemsetD8(reinterpret_cast<CUdeviceptr>(p), 0, nbytes), "cuMemsetD8");
  check(driver().api.cuCtxSynchronize(), "cuCtxSynchronize");
}

void copy(void* dst, const void* src, std::size_t nbytes) {
  const PointerInfo to = query(dst), from = query(src);
  Scope scope(to.device ? to.ordinal : (from.device ? from.ordinal : 0));
  check(driver().api.cuMemcpy(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), nbytes),
        "cuMemcpy");
  // cuMemcpy may return before a device-to-device copy is done.
  if (to.device && from.device) check(driver().api.cuCtxSynchronize(), "cuCtxSynchronize");
}

void bind_thread(int ordinal) {
  thread_local int bound = -1;
  if (bound == ordinal || ordinal < 0) return;
  CUcontext current = nullptr;
  Driver& d = ready();
  if (d.api.cuCtxGetCurrent(&current) == kSuccess && current == nullptr) {
    check(d.api.cuCtxSetCurrent(primary_context(ordinal)), "cuCtxSetCurrent");
  }
  // Also when the thread had a context (torch's): a process that only
  // registers GPU memory uses it too, and eager payloads bound for that
  // memory must take the driver's copy (messages.cc), never a CPU memcpy.
  note_use(ordinal);
  bound = ordinal;
}

}  // namespace tensorwire::cuda
