// Push vs pull between two processes on two cores, serial per transfer: the
// sender's tensor goes into a shared buffer (push: the sender copies, with a
// plain memcpy or streaming stores) or the receiver copies it out (pull); then
// the receiver reduces it (max) and acks. No tensorwire, no UCX: what the
// memory system alone gives, to choose the direct path's copy
// (cpp/src/core/bulk_copy.cc; results in bench/results/streaming_copy.txt).
//
// build: gcc -O2 -mavx2 -o push_pull bench/micro/push_pull.c
// run:   ./push_pull BYTES MODE ITERS [REFRESH]
//   MODE 0 push memcpy, 1 push streaming (AVX2), 2 pull memcpy,
//        3 pull streaming (SSE2), 4 push streaming (SSE2),
//        5 push rep movsb, 6 pull rep movsb (bulk_copy's copy from 64 KiB),
//        7 both (rep movsb): the sender copies the first half into the slot while
//          the waiting receiver copies the second half out of the sender's tensor
//   REFRESH 1: the sender rewrites its whole tensor before each transfer
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char* const kModes[] = {"push", "push-nt", "pull", "pull-nt", "push-nt-sse", "push-movsb",
                                     "pull-movsb", "both-movsb"};

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

static float max_of(const float* a, size_t n) {  // n a multiple of 16
  __m256 m0 = _mm256_set1_ps(-1e30f), m1 = m0;
  for (size_t i = 0; i < n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(a + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(a + i + 8));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
  float r = lanes[0];
  for (int i = 1; i < 8; i++) r = lanes[i] > r ? lanes[i] : r;
  return r;
}

// Streaming copies; dst 64-byte aligned, n a multiple of 64.
static void stream_avx2(void* dst, const void* src, size_t n) {
  char* d = dst;
  const char* s = src;
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(s + i));
    __m256i b = _mm256_loadu_si256((const __m256i*)(s + i + 32));
    _mm256_stream_si256((__m256i*)(d + i), a);
    _mm256_stream_si256((__m256i*)(d + i + 32), b);
  }
  _mm_sfence();
}

static void rep_movsb(void* dst, const void* src, size_t n) {
  __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}

static void stream_sse2(void* dst, const void* src, size_t n) {
  char* d = dst;
  const char* s = src;
  for (size_t i = 0; i < n; i += 16) _mm_stream_si128((__m128i*)(d + i), _mm_loadu_si128((const __m128i*)(s + i)));
  _mm_sfence();
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s BYTES MODE ITERS [REFRESH]\n", argv[0]);
    return 2;
  }
  size_t n = strtoull(argv[1], 0, 0);
  int mode = atoi(argv[2]), iters = atoi(argv[3]), refresh = argc > 4 ? atoi(argv[4]) : 0;
  if (n < 64 || n % 64 || mode < 0 || mode > 7 || iters < 1) {
    fprintf(stderr, "BYTES: a multiple of 64; MODE 0..7; ITERS >= 1\n");
    return 2;
  }
  // One shared mapping: flag and ack words, the sender's tensor (shared so a
  // pull can read it), the receiver's slot.
  char* shared = mmap(0, 2 * n + 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  _Atomic long* flag = (_Atomic long*)shared;
  _Atomic long* ack = (_Atomic long*)(shared + 64);
  _Atomic long* half = (_Atomic long*)(shared + 128);  // mode 7: the sender's half is in the slot
  char* src = shared + 4096;
  char* slot = src + n;
  memset(src, 0, 2 * n);
  float* tensor = (float*)src;
  for (size_t i = 0; i < n / 4; i++) tensor[i] = 0.5f;

  if (fork() == 0) {  // receiver
    pin(1);
    char* own = aligned_alloc(4096, n);
    memset(own, 0, n);
    for (long k = 1; k <= iters; k++) {
      while (atomic_load(flag) != k) {
      }
      const float* view = (const float*)slot;
      if (mode == 7) {
        rep_movsb(slot + n / 2, src + n / 2, n - n / 2);
        while (atomic_load(half) != k) {
        }
      }
      if (mode == 2 || mode == 3 || mode == 6) {
        if (mode == 2) memcpy(own, src, n);
        else if (mode == 6) rep_movsb(own, src, n);
        else stream_sse2(own, src, n);
        view = (const float*)own;
      }
      float m = max_of(view, n / 4);
      if (m != 1.0f + k) fprintf(stderr, "transfer %ld: max %f, expected %f\n", k, m, 1.0f + k);
      atomic_store(ack, k);
    }
    _exit(0);
  }
  pin(0);
  double* t = malloc(sizeof(double) * iters);
  for (long k = 1; k <= iters; k++) {
    if (refresh) {
      for (size_t i = 1; i < n / 4; i++) tensor[i] = 0.5f;
    }
    tensor[0] = 1.0f + k;
    double t0 = now_us();
    if (mode == 0) memcpy(slot, src, n);
    if (mode == 1) stream_avx2(slot, src, n);
    if (mode == 4) stream_sse2(slot, src, n);
    if (mode == 5) rep_movsb(slot, src, n);
    atomic_store(flag, k);
    if (mode == 7) {
      rep_movsb(slot, src, n / 2);
      atomic_store(half, k);
    }
    while (atomic_load(ack) != k) {
    }
    t[k - 1] = now_us() - t0;
  }
  wait(0);
  for (int i = 0; i < iters; i++) {  // sort for the median
    for (int j = i + 1; j < iters; j++) {
      if (t[j] < t[i]) {
        double x = t[i];
        t[i] = t[j];
        t[j] = x;
      }
    }
  }
  double med = t[iters / 2];
  printf("bytes %zu mode %-11s refresh %d median %9.1f us %7.0f MB/s\n", n, kModes[mode], refresh, med, n / med);
  return 0;
}
