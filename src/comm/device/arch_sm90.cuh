// Architecture-specific PTX, one wrapper per instruction, each named for what it does. Kernels never write PTX
// themselves; they call these (through memory.cuh / signal.cuh) so a new target is one file to port.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
#error \
    "Ferry's device code needs sm_80 or newer (it uses .sys-scope release/acquire and L1::no_allocate hints); build for sm_90a"
#endif

namespace ferry::device::arch {

// 16-byte load that bypasses L1 allocation through the non-coherent path: for data that no one writes during the
// kernel (the caller's input rows).
__device__ __forceinline__ int4 load_nc_v4(int4 const* ptr) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// 16-byte load through the coherent path (data another rank wrote and published before a signal we acquired).
__device__ __forceinline__ int4 load_v4(int4 const* ptr) {
  int4 v;
  asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

// 16-byte store that does not allocate in L1 (streamed rows, often to a peer over NVLink).
__device__ __forceinline__ void store_na_v4(int4* ptr, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Release store at system scope: every write this thread made before it (and, after a CTA barrier, every write the
// CTA made) is visible to any GPU that acquires the value. System scope because the reader is another GPU.
__device__ __forceinline__ void store_release_sys_u64(uint64_t* ptr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void store_release_sys_u32(uint32_t* ptr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// Relaxed store at system scope: a flag that publishes no data (latency ping-pong), so it needs no release fence;
// strong (not weak) so the polling peer is guaranteed to observe it eventually.
__device__ __forceinline__ void store_relaxed_sys_u64(uint64_t* ptr, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// Acquire load at system scope: later reads see everything published before the matching release.
__device__ __forceinline__ uint64_t load_acquire_sys_u64(uint64_t const* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ uint32_t load_acquire_sys_u32(uint32_t const* ptr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

// Relaxed (volatile) load at system scope, for polling; follow with fence_acquire_sys() once the value is seen.
__device__ __forceinline__ uint64_t load_relaxed_sys_u64(uint64_t const* ptr) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

// Atomic add with release semantics at system scope (a signal that counts arrivals).
__device__ __forceinline__ uint64_t atomic_add_release_sys_u64(uint64_t* ptr, uint64_t value) {
  uint64_t old;
  asm volatile("atom.release.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(ptr), "l"(value) : "memory");
  return old;
}

// Reduction (no return value) with release semantics at system scope: a counting signal that does not wait for the
// peer's reply (an atom would stall the thread for an NVLink round trip).
__device__ __forceinline__ void red_add_release_sys_u64(uint64_t* ptr, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// Full fence at system scope (acquire + release) for a thread that polled with relaxed loads or wrote with plain
// stores that another GPU must see.
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// Nanoseconds of the global timer (same clock on every SM of a GPU; coarse, but fine for multi-second bounds).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace ferry::device::arch
