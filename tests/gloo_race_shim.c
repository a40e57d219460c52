// The race behind the TP=2 heap corruption on CPU (docs/reliability.md, plugin.runtime.internals entry 10),
// made to happen every time and caught before it corrupts anything. Preload it (LD_PRELOAD) into a process that
// runs collectives over gloo.
//
// After each collective, a gloo worker thread of torch's ProcessGroupGloo::runLoop writes the collective's name
// into the group's status string, without a lock. When the string already holds a heap buffer (a long name such
// as ALLGATHER_COALESCED was there) and the new name is short (ALLREDUCE), the worker copies the characters into
// that buffer with memcpy; if another worker replaces the string's buffer in the meantime, it frees the old one,
// and the copy lands in freed memory, over glibc's free-list link.
//
// Here every memcpy called from runLoop first waits GLOO_RACE_DELAY_US microseconds (default 200), which turns a
// window of a few instructions into one that another worker's collective can finish in. If the destination's
// first 8 bytes changed while it waited (freeing a block writes its list link there), the copy is counted,
// reported on stderr and skipped, so the heap stays intact; with GLOO_RACE_SKIP=0 it is made all the same, and
// the process crashes as CI's did. gloo_race_copies() and gloo_race_hits() read the counts (ctypes); with
// GLOO_RACE_LOG=FILE, each process also appends its counts there at every 100th widened copy and at every hit.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

static void *(*libc_memcpy)(void *, const void *, size_t);
static uintptr_t loop_start, loop_end;  // ProcessGroupGloo::runLoop's machine code, once libtorch_cpu is loaded
static unsigned delay_us = 200;
static int skip = 1;
static const char *log_path;
static long calls, copies, hits;

long gloo_race_copies(void) { return copies; }
long gloo_race_hits(void) { return hits; }

static void log_counts(void) {
  if (!log_path) return;
  char line[120];
  int len = snprintf(line, sizeof line, "pid %d copies %ld hits %ld\n", (int)getpid(), copies, hits);
  int fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0) return;
  if (write(fd, line, len) < 0) {}
  close(fd);
}

static void find_run_loop(void) {
  void *lib = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return;
  void *fn = dlsym(lib, "_ZN4c10d16ProcessGroupGloo7runLoopEi");
  Dl_info info;
  const ElfW(Sym) *sym = NULL;
  if (!fn || !dladdr1(fn, &info, (void **)&sym, RTLD_DL_SYMENT) || !sym) return;
  const char *us = getenv("GLOO_RACE_DELAY_US");
  if (us) delay_us = (unsigned)atoi(us);
  const char *sk = getenv("GLOO_RACE_SKIP");
  if (sk) skip = atoi(sk);
  log_path = getenv("GLOO_RACE_LOG");
  loop_end = (uintptr_t)fn + sym->st_size;
  __atomic_store_n(&loop_start, (uintptr_t)fn, __ATOMIC_RELEASE);
}

void *memcpy(void *dst, const void *src, size_t n) {
  if (!libc_memcpy) {
    static __thread int resolving;
    if (resolving) {  // dlsym's own copies, before libc's memcpy is known
      volatile char *d = dst;
      const volatile char *s = src;
      for (size_t i = 0; i < n; i++) d[i] = s[i];
      return dst;
    }
    resolving = 1;
    libc_memcpy = (void *(*)(void *, const void *, size_t))dlsym(RTLD_NEXT, "memcpy");
    resolving = 0;
  }
  uintptr_t start = __atomic_load_n(&loop_start, __ATOMIC_ACQUIRE);
  if (!start) {
    if ((__atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED) & 0xffff) == 0) find_run_loop();
    return libc_memcpy(dst, src, n);
  }
  uintptr_t caller = (uintptr_t)__builtin_return_address(0);
  if (caller >= start && caller < loop_end && n >= 8) {
    uint64_t before = *(volatile uint64_t *)dst;
    long c = __atomic_add_fetch(&copies, 1, __ATOMIC_RELAXED);
    if (c % 100 == 0) log_counts();
    usleep(delay_us);
    if (*(volatile uint64_t *)dst != before) {
      long k = __atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED);
      char msg[200];
      int len = snprintf(msg, sizeof msg, "gloo_race_shim: pid %d: a %zu-byte name copy of runLoop met a block freed "
                         "while it waited (%ld so far)%s\n", (int)getpid(), n, k, skip ? ", skipped" : "");
      if (write(2, msg, len) < 0) {}
      log_counts();
      if (skip) return dst;  // the block was freed meanwhile: writing it would corrupt the heap
    }
  }
  return libc_memcpy(dst, src, n);
}
