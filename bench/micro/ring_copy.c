// Copying one buffer between two processes on this host, two ways, in one run:
//   ring: the sender copies piece after piece into a small ring both processes map and the
//         receiver copies each piece out (two copies of every byte, pipelined on two cores,
//         the ring staying in cache);
//   cma:  the split path's kernel copy, the sender writing the first half into the receiver's
//         buffer (process_vm_writev) while the receiver reads the second half out of the
//         sender's (process_vm_readv), at once.
// Sender on CPU 0, receiver on CPU 1, the same buffers every repetition (as a training step's).
// usage: ring_copy TOTAL PIECE SLOTS REPS   (prints MB/s, best and mean of REPS-1, for both)
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void pin(int cpu) { cpu_set_t c; CPU_ZERO(&c); CPU_SET(cpu, &c); sched_setaffinity(0, sizeof c, &c); }
static void relax(void) { __builtin_ia32_pause(); }
static uint64_t get(volatile uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
static void set(volatile uint64_t* w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

int main(int argc, char** argv) {
  if (argc != 5) { fprintf(stderr, "usage: %s TOTAL PIECE SLOTS REPS\n", argv[0]); return 2; }
  size_t total = strtoull(argv[1], 0, 0), piece = strtoull(argv[2], 0, 0);
  int slots = atoi(argv[3]), reps = atoi(argv[4]);
  if (!total || !piece || total % piece || slots < 1 || reps < 2) { fprintf(stderr, "bad arguments\n"); return 2; }
  size_t pieces = total / piece;
  // shared: the ring, then words: [0] pieces sent, [8] pieces taken, [16] go (cma round), [24] done (cma round),
  // [32] receiver's dst address, [40] receiver pid
  char* shm = mmap(0, piece * slots + 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  volatile uint64_t* w = (volatile uint64_t*)(shm + piece * slots);
  memset(shm, 0, piece * slots + 4096);
  char* src = aligned_alloc(4096, total); memset(src, 2, total);
  pid_t child = fork();
  if (child == 0) {  // the receiver
    pin(1);
    char* dst = aligned_alloc(4096, total); memset(dst, 1, total);
    set(&w[4], (uint64_t)(uintptr_t)dst); set(&w[5], (uint64_t)getpid());
    uint64_t k = 0;
    for (int r = 0; r < reps; r++)
      for (size_t j = 0; j < pieces; j++, k++) {
        while (get(&w[0]) <= k) relax();
        memcpy(dst + j * piece, shm + (k % slots) * piece, piece);
        set(&w[1], k + 1);
      }
    for (int r = 0; r < reps; r++) {  // cma: read the second half out of the sender's src
      while (get(&w[2]) <= (uint64_t)r) relax();
      struct iovec l = {dst + total / 2, total - total / 2}, rm = {src + total / 2, total - total / 2};
      if (process_vm_readv(getppid(), &l, 1, &rm, 1, 0) < 0) { perror("process_vm_readv"); _exit(1); }
      set(&w[3], r + 1);
    }
    _exit(0);
  }
  pin(0);
  while (!get(&w[5])) relax();
  double* t = malloc(sizeof(double) * reps);
  uint64_t k = 0;
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    for (size_t j = 0; j < pieces; j++, k++) {
      while (k >= (uint64_t)slots && get(&w[1]) < k - slots + 1) relax();
      memcpy(shm + (k % slots) * piece, src + j * piece, piece);
      set(&w[0], k + 1);
    }
    while (get(&w[1]) < k) relax();
    t[r] = now() - t0;
  }
  double best = 1e9, sum = 0;
  for (int r = 1; r < reps; r++) { if (t[r] < best) best = t[r]; sum += t[r]; }
  printf("ring %zu B, %zu B pieces x %d: best %.0f MB/s, mean %.0f MB/s\n", total, piece, slots, total / best / 1e6,
         total / (sum / (reps - 1)) / 1e6);
  pid_t rp = (pid_t)get(&w[5]);
  char* rdst = (char*)(uintptr_t)get(&w[4]);
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    set(&w[2], r + 1);
    struct iovec l = {src, total / 2}, rm = {rdst, total / 2};
    if (process_vm_writev(rp, &l, 1, &rm, 1, 0) < 0) { perror("process_vm_writev"); return 1; }
    while (get(&w[3]) <= (uint64_t)r) relax();
    t[r] = now() - t0;
  }
  best = 1e9; sum = 0;
  for (int r = 1; r < reps; r++) { if (t[r] < best) best = t[r]; sum += t[r]; }
  printf("cma  %zu B, halves at once:        best %.0f MB/s, mean %.0f MB/s\n", total, total / best / 1e6,
         total / (sum / (reps - 1)) / 1e6);
  int st; waitpid(child, &st, 0);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
