// runtime.cpp -- the emulator's scheduler: every Metal thread of a threadgroup runs
// as a fiber on a CPU worker thread; barriers and simd collectives suspend the fiber
// until the scheduler can release them with Metal's semantics.
//
// Loud by design: threads that exit while others wait at a barrier, threads waiting
// at different barriers, faults (guard pages behind buffers, stacks and threadgroup
// memory) and errors raised by kernel code end the launch with a message naming the
// thread, never with a hang or a crash.
//
// Threadgroup clusters (a kernel whose template list has the int XK_CLUSTER = C > 1, as
// CUDA's __cluster_dims__(C,1,1)): a worker runs the C consecutive threadgroups along x of
// a cluster at once, their threads side by side as fibers of one scheduler loop
// (run_cluster). Each threadgroup keeps its own threadgroup memory, attributes, simd
// collectives and threadgroup_barrier; xk_cluster_sync is a barrier over every thread of
// the cluster and xk_cluster_peer maps an address into a peer's threadgroup memory (the
// distributed shared memory of Hopper). A threadgroup whose threads have all returned
// while its peers run on loses its memory (PROT_NONE), as a CTA's shared memory is gone
// once it exits. Without XK_CLUSTER every threadgroup is a cluster of one.
#include "xk_abi.h"

#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if !(defined(__x86_64__) || defined(__aarch64__)) || defined(__APPLE__)
#define XK_UCONTEXT 1
#if defined(__APPLE__)
#define _XOPEN_SOURCE 600
#endif
#include <ucontext.h>
#endif

#define XK_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---------------------------------------------------------------------------
// Context switching
// ---------------------------------------------------------------------------
// Hand-written switches for x86-64 and aarch64 (ELF): save the callee-saved
// registers and the FP control state on the current stack, store the stack pointer,
// load the other one and restore. A new context is a fake frame whose return address
// is the fiber's entry. Elsewhere (macOS, other CPUs) ucontext does the same, slower.
#if !defined(XK_UCONTEXT) && defined(__x86_64__)
extern "C" __attribute__((visibility("hidden"))) void xk_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.hidden xk_ctx_switch
.type xk_ctx_switch,@function
xk_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size xk_ctx_switch,.-xk_ctx_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void ctx_switch(Context* from, Context* to) { xk_ctx_switch(&from->sp, to->sp); }
void ctx_make(Context* c, char* stack_lo, size_t size, void (*fn)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  memcpy(sp, csr, 8);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;  // r15 r14 r13 r12 rbx rbp
  sp[7] = reinterpret_cast<uint64_t>(fn);  // return address
  sp[8] = 0;                               // fake caller of fn
  c->sp = sp;
}
#elif !defined(XK_UCONTEXT) && defined(__aarch64__)
extern "C" __attribute__((visibility("hidden"))) void xk_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.hidden xk_ctx_switch
.type xk_ctx_switch,%function
xk_ctx_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mrs x9, fpcr
    str x9, [sp, #160]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldr x9, [sp, #160]
    msr fpcr, x9
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
.size xk_ctx_switch,.-xk_ctx_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void ctx_switch(Context* from, Context* to) { xk_ctx_switch(&from->sp, to->sp); }
void ctx_make(Context* c, char* stack_lo, size_t size, void (*fn)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + size) & ~uintptr_t(15);
  uint64_t* frame = reinterpret_cast<uint64_t*>(top - 176);
  memset(frame, 0, 176);
  frame[11] = reinterpret_cast<uint64_t>(fn);  // x30: where `ret` goes
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  frame[20] = fpcr;
  c->sp = frame;
}
#else
struct Context {
  ucontext_t uc;
};
inline void ctx_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
void ctx_make(Context* c, char* stack_lo, size_t size, void (*fn)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack_lo;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, fn, 0);
}
#endif

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// ---------------------------------------------------------------------------
// Launch description (mirrored by ctypes in kernel.py)
// ---------------------------------------------------------------------------
struct Region {  // a buffer, for naming faults
  const char* lo;
  const char* hi;        // one past the last byte the kernel may touch
  const char* guard_lo;  // guard page range behind it (or null)
  const char* guard_hi;
  const char* name;
  uint32_t elem_size;
  uint32_t pad_;
};

struct LaunchDesc {
  xk_entry_fn entry;
  void* const* buffers;
  uint32_t grid[3];
  uint32_t group[3];
  uint32_t schedule;  // 0 sequential, 1 reverse, 2 random
  uint32_t workers;
  uint64_t seed;
  uint64_t tg_bytes;
  uint64_t stack_bytes;
  uint32_t n_regions;
  uint32_t cluster;  // threadgroups per cluster along x (XK_CLUSTER); 0 or 1: none
  const Region* regions;
};

// AT_BARRIER: threadgroup_barrier; AT_CLUSTER: xk_cluster_sync.
enum State : uint8_t { READY, AT_BARRIER, AT_CLUSTER, AT_COLLECTIVE, DONE };

struct Fiber {
  Context ctx;
  xk_thread_attrs attrs;
  State state;
  uint8_t rank;      // its threadgroup, Worker::groups[rank] (the threadgroup's rank in its cluster)
  uint32_t simd;     // its simdgroup, Worker::simds[simd]
  const char* file;  // wait site
  uint32_t line, column;
  xk_collective* op;
  char* tg_mem;           // its threadgroup's memory
  xk_thread_slot_t slot;  // kernel code's per-thread state (the pending async copies)
};

// One threadgroup of the cluster a worker runs.
struct Group {
  uint32_t id[3];     // threadgroup_position_in_grid
  uint32_t first, n;  // its threads: Worker::fibers[first, first + n)
  uint32_t done;      // how many of them have returned
  char* tg_map;       // its threadgroup memory's mapping: Worker::tg_map_size bytes, then a guard page
  char* tg_mem;       // the memory (tg_bytes, 16-byte aligned), ending near the guard page
  bool retired;       // all its threads returned while peers ran on: the mapping is PROT_NONE
};

// One simdgroup: the threads Worker::fibers[first, first + width), width <= 32.
struct Simd {
  uint32_t first, width;
};

// Bytes of each thread's slot (runtime-owned: no allocation inside a fiber).
constexpr size_t kSlotBytes = 16384;

struct Launch;

// A CPU thread running clusters, one at a time. Its fibers, simdgroups and threadgroup
// memory are those of the cluster it runs: threadgroup after threadgroup, by rank.
struct Worker {
  Launch* launch = nullptr;
  Context sched;
  std::vector<Fiber> fibers;  // cluster * threads per threadgroup (the last groups may use fewer)
  std::vector<Group> groups;  // cluster
  std::vector<Simd> simds;
  char* stacks = nullptr;  // fibers * (guard page + stack)
  char* slots = nullptr;   // fibers * kSlotBytes (xk_thread_slot)
  size_t stack_stride = 0;
  size_t stacks_map = 0;
  char* tg_maps = nullptr;  // the groups' threadgroup memory mappings, each followed by a guard page
  size_t tg_map_size = 0;   // bytes of one mapping, without its guard page
  char* altstack = nullptr;
  Fiber* cur = nullptr;
  int in_resolver = 0;
  sigjmp_buf fault_jmp;
  std::vector<uint32_t> order;
  uint64_t rng = 0;
};

struct Launch {
  const LaunchDesc* d;
  std::atomic<uint64_t> next_cluster{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string error;
  uint64_t n_clusters = 0;
  uint32_t groups[3];    // threadgroups_per_grid
  uint32_t cluster = 1;  // threadgroups per cluster (along x)

  void fail(const std::string& msg) {
    std::lock_guard<std::mutex> g(err_mu);
    if (!failed.load()) {
      error = msg;
      failed.store(true);
    }
  }
};

thread_local Worker* tl_worker = nullptr;

std::string fmt(const char* f, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string who(const Fiber* f) {
  const xk_thread_attrs& a = f->attrs;
  return fmt("thread (%u,%u,%u) of threadgroup (%u,%u,%u) [thread_index_in_threadgroup %u, simdgroup %u lane %u]",
             a.thread_position_in_grid.x, a.thread_position_in_grid.y, a.thread_position_in_grid.z,
             a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z,
             a.thread_index_in_threadgroup, a.simdgroup_index_in_threadgroup, a.thread_index_in_simdgroup);
}

// "threadgroup (x,y,z)", for messages.
std::string group_name(const Group& g) { return fmt("threadgroup (%u,%u,%u)", g.id[0], g.id[1], g.id[2]); }

// "the cluster of threadgroups (x0..x1,y,z)", for messages.
std::string cluster_name(const Worker* w) {
  const Group& a = w->groups.front();
  const Group& b = w->groups.back();
  return fmt("the cluster of threadgroups (%u..%u,%u,%u)", a.id[0], b.id[0], a.id[1], a.id[2]);
}

// The third number only tells apart several calls on one line: not printed.
std::string site(const char* file, uint32_t line, uint32_t) { return fmt("%s:%u", file ? file : "?", line); }

// ---------------------------------------------------------------------------
// Faults: SIGSEGV/SIGBUS/SIGFPE in a fiber become launch errors
// ---------------------------------------------------------------------------
std::mutex g_sig_mu;
int g_sig_users = 0;
struct sigaction g_old_segv, g_old_bus, g_old_fpe, g_old_ill;

std::string describe_fault(Worker* w, const char* addr) {
  const LaunchDesc* d = w->launch->d;
  for (uint32_t i = 0; i < d->n_regions; ++i) {
    const Region& r = d->regions[i];
    if (r.guard_lo && addr >= r.guard_lo && addr < r.guard_hi) {
      long long byte = addr - r.lo;
      long long n = (r.hi - r.lo) / (r.elem_size ? r.elem_size : 1);
      return fmt("out-of-bounds access to buffer '%s': element %lld (byte offset %lld) of %lld", r.name,
                 byte / (long long)(r.elem_size ? r.elem_size : 1), byte, n);
    }
  }
  for (const Group& g : w->groups) {
    if (!g.tg_map || addr < g.tg_map || addr >= g.tg_map + w->tg_map_size + page_size()) continue;
    if (g.retired && addr < g.tg_map + w->tg_map_size)
      return fmt("access to the threadgroup memory of %s, whose threads had returned (a cluster peer must "
                 "xk_cluster_sync before returning: a threadgroup's memory is gone once its threads return)",
                 group_name(g).c_str());
    if (addr >= g.tg_mem)
      return fmt("out-of-bounds access to threadgroup memory: byte %lld of %llu declared%s",
                 (long long)(addr - g.tg_mem), (unsigned long long)w->launch->d->tg_bytes,
                 w->groups.size() > 1 ? (" (that of " + group_name(g) + ")").c_str() : "");
  }
  if (w->stacks && addr >= w->stacks && addr < w->stacks + w->stacks_map) {
    size_t off = (addr - w->stacks) % w->stack_stride;
    if (off < page_size())
      return fmt("stack overflow (each emulated thread has %llu KiB; set XLSTM_EMULATE_STACK_KB to raise it)",
                 (unsigned long long)(w->launch->d->stack_bytes / 1024));
  }
  if (addr == nullptr)
    return "invalid memory access (a null pointer, or a misaligned vector access: Metal buffers are "
           "16-byte aligned, so e.g. float4 loads need element offsets that are multiples of 4)";
  return fmt("invalid memory access at address %p", (const void*)addr);
}

void on_fault(int sig, siginfo_t* info, void* uctx) {
  Worker* w = tl_worker;
  if (w && w->cur) {
    std::string what;
    if (sig == SIGFPE)
      what = "arithmetic exception (integer division by zero?)";
    else if (sig == SIGILL)
      what = "illegal instruction (a trap in kernel code)";
    else
      what = describe_fault(w, static_cast<const char*>(info->si_addr));
    w->launch->fail(what + " by " + who(w->cur));
    siglongjmp(w->fault_jmp, 1);
  }
  // Not ours: hand it to whoever had it before.
  struct sigaction* old = sig == SIGSEGV ? &g_old_segv : sig == SIGBUS ? &g_old_bus : sig == SIGFPE ? &g_old_fpe : &g_old_ill;
  if (old->sa_flags & SA_SIGINFO) {
    if (old->sa_sigaction) {
      old->sa_sigaction(sig, info, uctx);
      return;
    }
  } else if (old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) {
    old->sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

void signals_acquire() {
  std::lock_guard<std::mutex> g(g_sig_mu);
  if (g_sig_users++ > 0) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
  sigaction(SIGFPE, &sa, &g_old_fpe);
  sigaction(SIGILL, &sa, &g_old_ill);
}

void signals_release() {
  std::lock_guard<std::mutex> g(g_sig_mu);
  if (--g_sig_users > 0) return;
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  sigaction(SIGFPE, &g_old_fpe, nullptr);
  sigaction(SIGILL, &g_old_ill, nullptr);
}

// ---------------------------------------------------------------------------
// Scheduler
// ---------------------------------------------------------------------------
void fiber_main() {
  Worker* w = tl_worker;
  Fiber* f = w->cur;
  w->launch->d->entry(w->launch->d->buffers, &f->attrs);
  f->state = DONE;
  ctx_switch(&f->ctx, &w->sched);
  abort();  // a finished fiber is never resumed
}

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

bool site_less(const Fiber* a, const Fiber* b) {
  if (a->line != b->line) return a->line < b->line;
  if (a->column != b->column) return a->column < b->column;
  int c = strcmp(a->file ? a->file : "", b->file ? b->file : "");
  return c < 0;
}
bool site_eq(const Fiber* a, const Fiber* b) { return !site_less(a, b) && !site_less(b, a); }

void set_uint3(xk_uint3& u, uint32_t x, uint32_t y, uint32_t z) {
  u.x = x;
  u.y = y;
  u.z = z;
  u.pad_ = 0;
}

// Lays out threadgroup `rank` of the cluster being started (threadgroup_position_in_grid
// g) as the fibers from `first` on and their simdgroups, and readies its threadgroup
// memory (given back its pages if the last cluster retired it, then poisoned). Returns
// its number of threads.
uint32_t start_group(Worker* w, uint32_t rank, const uint32_t g[3], uint32_t first) {
  Launch* L = w->launch;
  const LaunchDesc* d = L->d;
  uint32_t actual[3];
  for (int i = 0; i < 3; ++i) actual[i] = std::min(d->group[i], d->grid[i] - g[i] * d->group[i]);
  const uint32_t n = actual[0] * actual[1] * actual[2];
  const uint32_t n_dispatch = d->group[0] * d->group[1] * d->group[2];

  Group& grp = w->groups[rank];
  memcpy(grp.id, g, sizeof grp.id);
  grp.first = first;
  grp.n = n;
  grp.done = 0;
  if (grp.retired) {
    mprotect(grp.tg_map, w->tg_map_size, PROT_READ | PROT_WRITE);
    grp.retired = false;
  }
  if (d->tg_bytes) memset(grp.tg_mem, 0xFF, d->tg_bytes);  // poison

  for (uint32_t s0 = 0; s0 < n; s0 += 32) w->simds.push_back(Simd{first + s0, std::min<uint32_t>(32, n - s0)});
  const uint32_t simd0 = uint32_t(w->simds.size()) - (n + 31) / 32;

  for (uint32_t t = 0; t < n; ++t) {
    const uint32_t i = first + t;  // the fiber
    Fiber& f = w->fibers[i];
    xk_thread_attrs& a = f.attrs;
    uint32_t lx = t % actual[0], ly = (t / actual[0]) % actual[1], lz = t / (actual[0] * actual[1]);
    set_uint3(a.dispatch_threads_per_threadgroup, d->group[0], d->group[1], d->group[2]);
    set_uint3(a.grid_origin, 0, 0, 0);
    set_uint3(a.grid_size, d->grid[0], d->grid[1], d->grid[2]);
    set_uint3(a.thread_position_in_grid, g[0] * d->group[0] + lx, g[1] * d->group[1] + ly,
              g[2] * d->group[2] + lz);
    set_uint3(a.thread_position_in_threadgroup, lx, ly, lz);
    set_uint3(a.threadgroup_position_in_grid, g[0], g[1], g[2]);
    set_uint3(a.threadgroups_per_grid, L->groups[0], L->groups[1], L->groups[2]);
    set_uint3(a.threads_per_grid, d->grid[0], d->grid[1], d->grid[2]);
    set_uint3(a.threads_per_threadgroup, actual[0], actual[1], actual[2]);
    a.dispatch_quadgroups_per_threadgroup = (n_dispatch + 3) / 4;
    a.dispatch_simdgroups_per_threadgroup = (n_dispatch + 31) / 32;
    a.quadgroup_index_in_threadgroup = t / 4;
    a.quadgroups_per_threadgroup = (n + 3) / 4;
    a.simdgroup_index_in_threadgroup = t / 32;
    a.simdgroups_per_threadgroup = (n + 31) / 32;
    a.thread_execution_width = 32;
    a.thread_index_in_quadgroup = t % 4;
    a.thread_index_in_simdgroup = t % 32;
    a.thread_index_in_threadgroup = t;
    a.threads_per_simdgroup = 32;
    f.state = READY;
    f.rank = uint8_t(rank);
    f.simd = simd0 + t / 32;
    f.op = nullptr;
    f.file = nullptr;
    f.tg_mem = grp.tg_mem;
    f.slot.data = w->slots + size_t(i) * kSlotBytes;  // zeroed: no state left by the last thread here
    f.slot.bytes = kSlotBytes;
    memset(f.slot.data, 0, 64);
    ctx_make(&f.ctx, w->stacks + size_t(i) * w->stack_stride + page_size(), w->stack_stride - page_size(),
             fiber_main);
  }
  return n;
}

// A threadgroup whose threads have all returned while its cluster peers run on: its
// memory becomes inaccessible, so a peer that reads it now faults (describe_fault).
void retire_group(Worker* w, Group& g) {
  mprotect(g.tg_map, w->tg_map_size, PROT_NONE);
  g.retired = true;
}

inline bool can_move(const Fiber& f) { return f.state == READY || f.state == AT_COLLECTIVE; }

bool any_can_move(const Worker* w, uint32_t first, uint32_t end) {
  for (uint32_t t = first; t < end; ++t)
    if (can_move(w->fibers[t])) return true;
  return false;
}

enum Release { NOTHING, RELEASED, FAILED };

// A threadgroup none of whose threads can move: if they wait at a threadgroup_barrier,
// check that every thread of the group waits at that same one and release it.
Release release_group_barrier(Worker* w, Group& g) {
  Launch* L = w->launch;
  Fiber* at = nullptr;  // the first thread at a threadgroup barrier
  Fiber* at_cluster = nullptr;
  for (uint32_t t = g.first; t < g.first + g.n; ++t) {
    Fiber* f = &w->fibers[t];
    if (f->state == AT_CLUSTER && !at_cluster) at_cluster = f;
    if (f->state != AT_BARRIER) continue;
    if (!at) {
      at = f;
    } else if (!site_eq(f, at)) {
      L->fail(fmt("barrier mismatch in threadgroup (%u,%u,%u): threads wait at different "
                  "threadgroup_barrier calls, %s (e.g. thread_index_in_threadgroup %u) and %s (thread %u)%s",
                  g.id[0], g.id[1], g.id[2], site(at->file, at->line, at->column).c_str(),
                  at->attrs.thread_index_in_threadgroup, site(f->file, f->line, f->column).c_str(),
                  f->attrs.thread_index_in_threadgroup,
                  at->line == f->line ? " (two different calls on that line)" : ""));
      return FAILED;
    }
  }
  if (!at) return NOTHING;
  if (at_cluster) {
    L->fail(fmt("barrier mismatch in threadgroup (%u,%u,%u): threads wait at threadgroup_barrier at %s (e.g. "
                "thread_index_in_threadgroup %u) while others wait at xk_cluster_sync at %s (thread %u). Every "
                "thread of a threadgroup must reach the same barriers, in the same order.",
                g.id[0], g.id[1], g.id[2], site(at->file, at->line, at->column).c_str(),
                at->attrs.thread_index_in_threadgroup,
                site(at_cluster->file, at_cluster->line, at_cluster->column).c_str(),
                at_cluster->attrs.thread_index_in_threadgroup));
    return FAILED;
  }
  if (g.done > 0) {
    uint32_t exited = 0;
    for (uint32_t t = 0; t < g.n; ++t)
      if (w->fibers[g.first + t].state == DONE) {
        exited = t;
        break;
      }
    L->fail(fmt("barrier divergence in threadgroup (%u,%u,%u): %u of %u threads returned while %u wait at "
                "threadgroup_barrier at %s (first exited: thread_index_in_threadgroup %u). Every thread of a "
                "threadgroup must reach each barrier: do not return early before a barrier.",
                g.id[0], g.id[1], g.id[2], g.done, g.n, g.n - g.done, site(at->file, at->line, at->column).c_str(),
                exited));
    return FAILED;
  }
  for (uint32_t t = g.first; t < g.first + g.n; ++t) w->fibers[t].state = READY;
  return RELEASED;
}

// Every thread of the cluster that has not returned waits at xk_cluster_sync: check that
// they all wait at the same one and that none has returned, and release it.
bool release_cluster_sync(Worker* w, uint32_t n, uint32_t done) {
  Launch* L = w->launch;
  Fiber* at = nullptr;
  for (uint32_t t = 0; t < n; ++t) {
    Fiber* f = &w->fibers[t];
    if (f->state != AT_CLUSTER) continue;
    if (!at) {
      at = f;
    } else if (!site_eq(f, at)) {
      const xk_uint3 &ga = at->attrs.threadgroup_position_in_grid, &gf = f->attrs.threadgroup_position_in_grid;
      L->fail(fmt("cluster sync mismatch in %s: threads wait at different xk_cluster_sync calls, %s (e.g. "
                  "thread_index_in_threadgroup %u of threadgroup (%u,%u,%u)) and %s (thread %u of threadgroup "
                  "(%u,%u,%u))%s",
                  cluster_name(w).c_str(), site(at->file, at->line, at->column).c_str(),
                  at->attrs.thread_index_in_threadgroup, ga.x, ga.y, ga.z, site(f->file, f->line, f->column).c_str(),
                  f->attrs.thread_index_in_threadgroup, gf.x, gf.y, gf.z,
                  at->line == f->line ? " (two different calls on that line)" : ""));
      return false;
    }
  }
  if (!at) {  // unreachable: run_cluster calls this only when every live thread waits here
    L->fail("emulator scheduler: no thread of " + cluster_name(w) + " can move (an emulator bug)");
    return false;
  }
  if (done > 0) {
    const Fiber* exited = nullptr;
    for (uint32_t t = 0; t < n && !exited; ++t)
      if (w->fibers[t].state == DONE) exited = &w->fibers[t];
    const xk_uint3& ge = exited->attrs.threadgroup_position_in_grid;
    L->fail(fmt("cluster sync divergence in %s: %u of %u threads returned while %u wait at xk_cluster_sync at %s "
                "(first exited: thread_index_in_threadgroup %u of threadgroup (%u,%u,%u)). Every thread of every "
                "threadgroup of a cluster must reach each xk_cluster_sync: do not return early before one.",
                cluster_name(w).c_str(), done, n, n - done, site(at->file, at->line, at->column).c_str(),
                exited->attrs.thread_index_in_threadgroup, ge.x, ge.y, ge.z));
    return false;
  }
  for (uint32_t t = 0; t < n; ++t) w->fibers[t].state = READY;
  return true;
}

// Runs one cluster (one threadgroup without XK_CLUSTER) to completion. Returns false if
// the launch failed.
bool run_cluster(Worker* w, uint64_t cid) {
  Launch* L = w->launch;
  const LaunchDesc* d = L->d;
  const uint32_t C = L->cluster;
  const uint32_t cx = L->groups[0] / C;  // clusters along x
  const uint32_t c[3] = {uint32_t(cid % cx), uint32_t((cid / cx) % L->groups[1]),
                         uint32_t(cid / (uint64_t(cx) * L->groups[1]))};
  w->simds.clear();
  uint32_t n = 0;  // threads of the cluster
  for (uint32_t r = 0; r < C; ++r) {
    const uint32_t g[3] = {c[0] * C + r, c[1], c[2]};
    n += start_group(w, r, g, n);
  }

  std::vector<uint32_t>& order = w->order;
  order.resize(n);
  for (uint32_t t = 0; t < n; ++t) order[t] = d->schedule == 1 ? n - 1 - t : t;
  w->rng = d->seed * 0x2545F4914F6CDD1Dull ^ (cid + 1) * 0x9E3779B97F4A7C15ull;

  const uint32_t n_simd = uint32_t(w->simds.size());
  const bool lockstep = d->schedule == 0;
  int32_t prev_lead = -1;
  uint32_t done = 0;
  for (;;) {
    if (d->schedule == 2)
      for (uint32_t i = n; i > 1; --i) std::swap(order[i - 1], order[splitmix(w->rng) % i]);
    // The sequential schedule runs all simdgroups of the cluster side by side. Reverse
    // and random run one simdgroup (the first in the schedule's order that can move)
    // until all its lanes wait at a barrier or end, then the next: simdgroups drift as
    // far apart as a barrier allows, so one that overwrites threadgroup memory another
    // has not read yet (a missing barrier, or scratch reused across reductions) gives
    // different bits from the sequential schedule. Their threadgroup barriers are
    // released as soon as the lead's threadgroup has stopped, so a threadgroup runs
    // ahead of its cluster peers up to a cluster sync (a missing xk_cluster_sync shows).
    int32_t lead = -1;
    if (!lockstep && prev_lead >= 0) {  // keep running the same simdgroup while it can move
      const Simd& s = w->simds[prev_lead];
      if (any_can_move(w, s.first, s.first + s.width)) lead = prev_lead;
    }
    if (!lockstep && lead < 0) {
      for (uint32_t i = 0; i < n && lead < 0; ++i)
        if (w->fibers[order[i]].state == READY) lead = int32_t(w->fibers[order[i]].simd);
      for (uint32_t i = 0; i < n && lead < 0; ++i)
        if (w->fibers[order[i]].state == AT_COLLECTIVE) lead = int32_t(w->fibers[order[i]].simd);
    }
    prev_lead = lead;
    // 1. Run every ready thread (of the lead simdgroup) until it blocks or ends.
    for (uint32_t i = 0; i < n; ++i) {
      Fiber& f = w->fibers[order[i]];
      if (f.state != READY || (lead >= 0 && f.simd != uint32_t(lead))) continue;
      w->cur = &f;
      ctx_switch(&w->sched, &f.ctx);
      w->cur = nullptr;
      if (L->failed.load(std::memory_order_relaxed)) return false;
      if (f.state == DONE) {
        ++done;
        Group& g = w->groups[f.rank];
        if (++g.done == g.n && done < n) retire_group(w, g);  // only in a cluster of several
      }
    }
    if (done == n) return true;

    // 2. Release simd collectives: per simdgroup, the earliest call site that lanes
    //    wait at, with the lanes waiting there as the active set. The sequential
    //    schedule releases every simdgroup at once (lockstep); reverse and random only
    //    the lead simdgroup, which then runs on (see above).
    bool released = false;
    for (uint32_t s = 0; s < n_simd; ++s) {
      if (lead >= 0 && s != uint32_t(lead)) continue;
      Fiber* lane0 = &w->fibers[w->simds[s].first];
      const uint32_t width = w->simds[s].width;
      Fiber* first = nullptr;
      for (uint32_t l = 0; l < width; ++l) {
        Fiber* f = lane0 + l;
        if (f->state == AT_COLLECTIVE && (!first || site_less(f, first))) first = f;
      }
      if (!first) continue;
      xk_collective* lanes[32] = {nullptr};
      for (uint32_t l = 0; l < width; ++l) {
        Fiber* f = lane0 + l;
        if (f->state == AT_COLLECTIVE && site_eq(f, first)) {
          if (f->op->resolve != first->op->resolve) {
            L->fail(fmt("simdgroup %u of %s: lanes call different simd functions at %s (%s and %s)",
                        f->attrs.simdgroup_index_in_threadgroup, group_name(w->groups[f->rank]).c_str(),
                        site(f->file, f->line, f->column).c_str(), f->op->what, first->op->what));
            return false;
          }
          lanes[l] = f->op;
        }
      }
      if (first->op->resolve) {
        w->cur = first;
        w->in_resolver = 1;
        first->op->resolve(lanes, int(width));
        w->in_resolver = 0;
        w->cur = nullptr;
        if (L->failed.load()) return false;
      }
      for (uint32_t l = 0; l < width; ++l)
        if (lanes[l]) lane0[l].state = READY;
      released = true;
    }
    if (released) continue;
    if (lead >= 0) {
      // Other simdgroups of the lead's threadgroup may still have work before its barrier.
      Group& g = w->groups[w->fibers[w->simds[lead].first].rank];
      if (any_can_move(w, g.first, g.first + g.n)) continue;
      const Release r = release_group_barrier(w, g);
      if (r == FAILED) return false;
      if (r == RELEASED) continue;
      // It waits at a cluster sync (or has returned): its peers may still have work before it.
      if (C > 1 && any_can_move(w, 0, n)) continue;
    }

    // 3. No thread of the cluster can move. Threads waiting at a threadgroup barrier
    //    (all of their group, at the same one) go on first.
    bool any = false;
    for (Group& g : w->groups) {
      const Release r = release_group_barrier(w, g);
      if (r == FAILED) return false;
      any = any || r == RELEASED;
    }
    if (any) continue;
    // 4. Every thread left waits at xk_cluster_sync: it must be the same one.
    if (!release_cluster_sync(w, n, done)) return false;
  }
}

void* map_or_die(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

bool worker_setup(Worker* w, Launch* L) {
  const LaunchDesc* d = L->d;
  const size_t ps = page_size();
  const uint32_t C = L->cluster;
  const uint32_t n = C * d->group[0] * d->group[1] * d->group[2];  // fibers
  w->launch = L;
  w->fibers.resize(n);
  w->simds.reserve(C * ((d->group[0] * d->group[1] * d->group[2] + 31) / 32));
  w->stack_stride = round_up(d->stack_bytes, ps) + ps;
  w->stacks_map = w->stack_stride * n;
  w->stacks = static_cast<char*>(map_or_die(w->stacks_map));
  if (!w->stacks) return false;
  for (uint32_t t = 0; t < n; ++t) mprotect(w->stacks + size_t(t) * w->stack_stride, ps, PROT_NONE);
  const size_t tg = round_up(std::max<uint64_t>(d->tg_bytes, 16), ps);
  w->tg_map_size = tg;
  w->tg_maps = static_cast<char*>(map_or_die((tg + ps) * C));
  if (!w->tg_maps) return false;
  w->groups.resize(C);
  for (uint32_t r = 0; r < C; ++r) {
    Group& g = w->groups[r];
    g.tg_map = w->tg_maps + (tg + ps) * r;
    mprotect(g.tg_map + tg, ps, PROT_NONE);
    g.tg_mem = g.tg_map + tg - round_up(d->tg_bytes, 16);
    g.retired = false;
  }
  w->slots = static_cast<char*>(map_or_die(kSlotBytes * n));
  if (!w->slots) return false;
  w->altstack = static_cast<char*>(map_or_die(1 << 16));
  return w->altstack != nullptr;
}

void worker_teardown(Worker* w) {
  if (w->stacks) munmap(w->stacks, w->stacks_map);
  if (w->slots) munmap(w->slots, kSlotBytes * w->fibers.size());
  if (w->tg_maps) munmap(w->tg_maps, (w->tg_map_size + page_size()) * w->groups.size());
  if (w->altstack) munmap(w->altstack, 1 << 16);
}

void worker_run(Worker* w) {
  Launch* L = w->launch;
  tl_worker = w;
  stack_t ss, old_ss;
  ss.ss_sp = w->altstack;
  ss.ss_size = 1 << 16;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  if (sigsetjmp(w->fault_jmp, 1) == 0) {
    for (;;) {
      if (L->failed.load()) break;
      uint64_t cid = L->next_cluster.fetch_add(1);
      if (cid >= L->n_clusters) break;
      if (!run_cluster(w, cid)) break;
    }
  }
  w->cur = nullptr;
  sigaltstack(&old_ss, nullptr);
  tl_worker = nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------
// Services for kernel code
// ---------------------------------------------------------------------------
namespace {
// Parks the running thread at a barrier of kind `state` (its site kept for the scheduler's
// checks and messages) until the scheduler releases it.
void park_at(State state, const char* file, uint32_t line, uint32_t column) {
  Worker* w = tl_worker;
  Fiber* f = w->cur;
  f->state = state;
  f->file = file;
  f->line = line;
  f->column = column;
  ctx_switch(&f->ctx, &w->sched);
}
}  // namespace

XK_EXPORT void xk_threadgroup_barrier(const char* file, uint32_t line, uint32_t column) {
  park_at(AT_BARRIER, file, line, column);
}

XK_EXPORT void xk_collective_wait(xk_collective* op) {
  Worker* w = tl_worker;
  Fiber* f = w->cur;
  f->state = AT_COLLECTIVE;
  f->file = op->file;
  f->line = op->line;
  f->column = op->column;
  f->op = op;
  ctx_switch(&f->ctx, &w->sched);
  f->op = nullptr;
}

// xk_cluster_sync: a barrier over every thread of every threadgroup of the cluster.
XK_EXPORT void xk_cluster_barrier(const char* file, uint32_t line, uint32_t column) {
  park_at(AT_CLUSTER, file, line, column);
}

XK_EXPORT void* xk_cluster_peer_address(const void* p, uint32_t rank) {
  Worker* w = tl_worker;
  const char* c = static_cast<const char*>(p);
  const char* lo = w->cur->tg_mem;
  const uint64_t bytes = w->launch->d->tg_bytes;
  char msg[512];
  if (c < lo || c >= lo + bytes) {
    snprintf(msg, sizeof msg,
             "xk_cluster_peer: the address %p is not in the calling threadgroup's threadgroup memory "
             "(%llu bytes at %p); pass a pointer into a threadgroup array of the kernel",
             p, (unsigned long long)bytes, (const void*)lo);
    xk_error(msg);
  }
  if (rank >= w->groups.size()) {
    snprintf(msg, sizeof msg, "xk_cluster_peer: rank %u, but the cluster has %u threadgroups (XK_CLUSTER = %u)",
             rank, unsigned(w->groups.size()), unsigned(w->groups.size()));
    xk_error(msg);
  }
  return w->groups[rank].tg_mem + (c - lo);
}

XK_EXPORT char* xk_threadgroup_memory(void) { return tl_worker->cur->tg_mem; }
XK_EXPORT xk_thread_slot_t* xk_thread_slot(void) { return &tl_worker->cur->slot; }
XK_EXPORT uint32_t xk_lane(void) { return tl_worker->cur->attrs.thread_index_in_simdgroup; }
XK_EXPORT uint32_t xk_simd_width(void) {
  const xk_thread_attrs& a = tl_worker->cur->attrs;
  uint32_t n = a.threads_per_threadgroup.x * a.threads_per_threadgroup.y * a.threads_per_threadgroup.z;
  return std::min<uint32_t>(32, n - a.simdgroup_index_in_threadgroup * 32);
}

XK_EXPORT void xk_error(const char* message) {
  Worker* w = tl_worker;
  if (!w || !w->cur) {
    fprintf(stderr, "xlstm_kernels.emulate: %s\n", message);
    abort();
  }
  if (w->in_resolver) {
    const xk_thread_attrs& a = w->cur->attrs;
    w->launch->fail(fmt("%s (simdgroup %u of threadgroup (%u,%u,%u))", message, a.simdgroup_index_in_threadgroup,
                        a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y,
                        a.threadgroup_position_in_grid.z));
    return;
  }
  Fiber* f = w->cur;
  w->launch->fail(std::string(message) + " by " + who(f));
  f->state = DONE;
  ctx_switch(&f->ctx, &w->sched);
  abort();
}

// ---------------------------------------------------------------------------
// Entry points for Python (ctypes)
// ---------------------------------------------------------------------------
// 2: LaunchDesc::cluster (was padding).
XK_EXPORT int xk_abi_version(void) { return 2; }

XK_EXPORT int xk_launch(const LaunchDesc* d, char* err, size_t errlen) {
  Launch L;
  L.d = d;
  uint32_t n = d->group[0] * d->group[1] * d->group[2];
  if (n == 0 || n > 1024) {
    snprintf(err, errlen, "threadgroup of %u threads (must be 1..1024)", n);
    return 1;
  }
  L.cluster = d->cluster ? d->cluster : 1;
  uint64_t n_groups = 1;
  for (int i = 0; i < 3; ++i) {
    L.groups[i] = d->grid[i] == 0 ? 0 : (d->grid[i] + d->group[i] - 1) / d->group[i];
    n_groups *= L.groups[i];
  }
  if (L.cluster > 8 || L.groups[0] % L.cluster != 0) {
    snprintf(err, errlen, "XK_CLUSTER = %u with %u threadgroups along x (expected 1..8 dividing them)", L.cluster,
             L.groups[0]);
    return 1;
  }
  L.n_clusters = n_groups / L.cluster;
  if (L.n_clusters == 0) return 0;
  uint32_t nw = std::max<uint32_t>(1, std::min<uint64_t>(d->workers, L.n_clusters));
  std::vector<Worker> workers(nw);
  bool ok = true;
  for (auto& w : workers) ok = ok && worker_setup(&w, &L);
  if (!ok) {
    for (auto& w : workers) worker_teardown(&w);
    snprintf(err, errlen, "could not map memory for %u emulated threads per group (%u groups a cluster): %s", n,
             L.cluster, strerror(errno));
    return 1;
  }
  signals_acquire();
  if (nw == 1) {
    worker_run(&workers[0]);
  } else {
    std::vector<std::thread> threads;
    for (auto& w : workers) threads.emplace_back(worker_run, &w);
    for (auto& t : threads) t.join();
  }
  signals_release();
  for (auto& w : workers) worker_teardown(&w);
  if (L.failed.load()) {
    snprintf(err, errlen, "%s", L.error.c_str());
    return 1;
  }
  return 0;
}

// Memory whose end abuts a PROT_NONE page: a read or write past the end faults. The
// start is 16-byte aligned (as Metal buffers are, so vector loads work), which leaves
// up to 15 bytes of slack before the guard page; the caller canary-checks them.
XK_EXPORT void* xk_guarded_alloc(size_t nbytes, void** map_base, size_t* map_size) {
  const size_t ps = page_size();
  size_t body = round_up(std::max<size_t>(nbytes, 1), ps);
  char* base = static_cast<char*>(map_or_die(body + ps));
  if (!base) return nullptr;
  mprotect(base + body, ps, PROT_NONE);
  *map_base = base;
  *map_size = body + ps;
  uintptr_t start = (reinterpret_cast<uintptr_t>(base + body) - nbytes) & ~uintptr_t(15);
  return reinterpret_cast<void*>(start);
}

XK_EXPORT void xk_guarded_free(void* map_base, size_t map_size) { munmap(map_base, map_size); }
XK_EXPORT size_t xk_page_size(void) { return page_size(); }
