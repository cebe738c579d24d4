// Copyright tensorwire authors.
//
// The few CUDA driver calls the core needs, resolved at run time from
// libcuda.so.1: the build needs no CUDA, and a process that never touches
// GPU memory never loads the driver. UCX moves the bytes (cuda_copy,
// cuda_ipc, gdr_copy); this file only allocates, classifies pointers and
// copies where the core itself places bytes (an eager message into GPU
// memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tensorwire::cuda {

// Whether the driver loaded and initialised and sees at least one GPU
// (loads it on the first call; cheap afterwards).
bool available();
// Why not, when available() is false ("libcuda.so.1 not found", ...).
std::string unavailable_reason();
int device_count();
std::string device_name(int ordinal);
int driver_version();  // e.g. 13000; 0 when unavailable

// Whether this process has used GPU memory through the core (allocated or
// registered some): until then nothing below is ever asked per operation.
bool in_use();

struct PointerInfo {
  bool device = false;      // memory the GPU owns (cudaMalloc/cuMemAlloc)
  int ordinal = -1;         // its GPU
  std::uintptr_t base = 0;  // the allocation holding it
  std::size_t size = 0;
};
// What `p` is; device == false for host memory, unknown or freed pointers.
PointerInfo query(const void* p);

// GPU memory on `ordinal` (its primary context); InvalidArgument for an
// ordinal out of range, PoolExhausted when the GPU has no room.
void* allocate(int ordinal, std::size_t nbytes);
void release(int ordinal, void* p) noexcept;
void zero(int ordinal, void* p, std::size_t nbytes);
// A synchronous copy between any two of host and GPU memory (unified
// addressing says which is which).
void copy(void* dst, const void* src, std::size_t nbytes);
// Makes `ordinal`'s primary context current in the calling thread if no
// context is (UCX's CUDA transports act in the caller's context). Cheap
// when already done in this thread.
void bind_thread(int ordinal);
// The first GPU this process allocated or registered on (-1: none yet).
int first_ordinal();

}  // namespace tensorwire::cuda
