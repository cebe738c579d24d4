// Copyright tensorwire authors.
// The copy behind the direct path (a same-host peer's region mapped through
// shared memory): what a NIC's DMA engine does on a real fabric, done by the CPU.
#pragma once

#include <cstddef>

namespace tensorwire {
namespace detail {

// Copies n bytes. From 64 KiB, on x86-64 CPUs with ERMS, by `rep movsb`:
// glibc's memcpy uses it only below the L2's size on AMD and vector loops
// above, and the microcode's copy is much quicker into lines another core
// holds, a static slot's case (bench/results/static_slot_breakdown.txt, Zen 5
// VM: a 1 MiB push and its reduction 24.0 against 32.8 us, 64 MiB 3.90 against
// 4.91 ms; streaming stores 50 us and 3.96 ms).
// Copies larger than half the last-level cache use
// non-temporal (streaming) stores on x86-64: the destination would not stay
// cached anyway, and streaming stores skip the read-for-ownership of every
// destination line and leave no dirty lines in this core's cache for the
// peer's core to fetch (bench/results/streaming_copy.txt: 15-30% faster
// from 64 MiB up on this machine, even at 32 MiB, slower below the L3). The stores are
// fenced before returning, so the bytes are ordered before any later store.
void bulk_copy(void* dst, const void* src, std::size_t n);

// Always streams (x86-64; a plain memcpy elsewhere), whatever the size.
void streaming_copy(void* dst, const void* src, std::size_t n);

// The size from which bulk_copy streams: TENSORWIRE_STREAMING_COPY_MIN
// (bytes, 0 = never) if set, else half the last-level cache (32 MiB assumed
// when the system does not say). Read once.
std::size_t streaming_copy_min();

// The same, read now: throws InvalidArgument for a malformed
// TENSORWIRE_STREAMING_COPY_MIN (each Device checks it when created).
std::size_t streaming_copy_min_from_env();

// The size from which bulk_copy (below the streaming size) uses `rep movsb`:
// TENSORWIRE_REP_MOVSB_MIN (bytes, 0 = never) if set, else 64 KiB; never
// where the CPU lacks ERMS. Read once; the _from_env form reads it now and
// throws InvalidArgument when it is malformed.
std::size_t rep_movsb_min();
std::size_t rep_movsb_min_from_env();

// The smallest static-slot tensor whose copy a waiting receiver shares
// (protocol/static_slot.cc, SharedCopy): TENSORWIRE_SHARED_COPY_MIN (bytes,
// 0 = never) if set, else 256 KiB. Read once; the _from_env form reads it
// now and throws InvalidArgument when it is malformed.
std::size_t shared_copy_min();
std::size_t shared_copy_min_from_env();

}  // namespace detail
}  // namespace tensorwire
