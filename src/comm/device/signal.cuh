// Signals between ranks and bounded waits. Every wait here ends: on FERRY_TIMEOUT_S it records (rank, peer, phase,
// expected, observed) in the host-visible error block and returns false; the host raises TimeoutError.
#pragma once

#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "ferry/device_view.hpp"

namespace ferry::device {

// Publishes `value` at a peer's (or our own) signal word. Release at system scope: writes this thread made before
// are visible to whoever acquires the value. To publish a whole CTA's writes, __syncthreads() first, then one
// thread signals (the barrier orders the CTA's writes before the release; cumulativity carries them).
__device__ __forceinline__ void signal_set(uint64_t* signal, uint64_t value) {
  arch::store_release_sys_u64(signal, value);
}

// Adds to a signal word (several writers counting into one word), release at system scope.
__device__ __forceinline__ void signal_add(uint64_t* signal, uint64_t value) {
  arch::red_add_release_sys_u64(signal, value);
}

// True once another thread of this rank recorded a failure: waits stop early instead of each running to its bound.
__device__ __forceinline__ bool device_failed(DeviceView const& view) {
  return *reinterpret_cast<uint32_t const volatile*>(&view.error->status) != 0;
}

// Records a failure of status `status` (kErrorTimeout, kErrorOutOfStep) in the error block; only the first failure on
// this rank is kept (status 0 -> 1 by compare-and-swap, the fields, then the final status).
__device__ __forceinline__ void record_failure(DeviceView const& view, uint32_t status, int peer, WaitPhase phase,
                                               uint64_t expected, uint64_t observed) {
  DeviceErrorBlock* block = view.error;
  if (atomicCAS(&block->status, 0u, 1u) == 0u) {
    block->rank = view.rank;
    block->peer = peer;
    block->phase = static_cast<int32_t>(phase);
    block->expected = expected;
    block->observed = observed;
    __threadfence_system();
    atomicExch(&block->status, status);
  }
}

// Adds `peer` to the ranks this rank's waits gave up on (DeviceErrorBlock::absent).
__device__ __forceinline__ void record_absent(DeviceView const& view, int peer) {
  if (peer >= 0 && peer < 32 * kAbsentWords) atomicOr(&view.error->absent[peer >> 5], 1u << (peer & 31));
}

// Records a timeout in the error block (only the first failure on this rank is kept) and its peer as absent.
__device__ __forceinline__ void record_timeout(DeviceView const& view, int peer, WaitPhase phase, uint64_t expected,
                                               uint64_t observed) {
  record_absent(view, peer);
  record_failure(view, kErrorTimeout, peer, phase, expected, observed);
}

// A wait that stops because another one of this rank failed: its peer is absent too if its signal is still short, so
// that the host can name every missing rank (a whole node), not only the first.
__device__ __forceinline__ bool stop_waiting(DeviceView const& view, int peer, uint64_t value, uint64_t expected) {
  if (value < expected) record_absent(view, peer);
  return false;
}

// Spins until *signal >= expected (acquire) and leaves the value that satisfied it in *observed (a
// signal that carries a flag or a peer's sequence number besides what the wait needs). Returns false on timeout
// (recorded) or when this rank already failed. Called by one thread; the caller broadcasts the outcome to its group.
// sleep_ns > 0: a pause between polls, for waits expected to last long (many CTAs polling for tens of us), at the cost
// of up to ~2 x sleep_ns of latency.
__device__ __forceinline__ bool wait_signal_geq_value(DeviceView const& view, uint64_t const* signal, uint64_t expected,
                                                      int peer, WaitPhase phase, uint64_t* observed,
                                                      unsigned sleep_ns = 0) {
  uint64_t value = arch::load_acquire_sys_u64(signal);
  if (value >= expected) {
    *observed = value;
    return true;
  }
  uint64_t const start = arch::global_timer_ns();
  uint32_t spins = 0;
  while (true) {
    if (sleep_ns != 0) __nanosleep(sleep_ns);
    value = arch::load_acquire_sys_u64(signal);
    if (value >= expected) {
      *observed = value;
      return true;
    }
    if ((++spins & 255u) == 0u) {
      if (device_failed(view)) return stop_waiting(view, peer, value, expected);
      if (arch::global_timer_ns() - start > view.timeout_ns) {
        record_timeout(view, peer, phase, expected, value);
        return false;
      }
    }
  }
}

// wait_signal_geq_value without the value.
__device__ __forceinline__ bool wait_signal_geq(DeviceView const& view, uint64_t const* signal, uint64_t expected,
                                                int peer, WaitPhase phase, unsigned sleep_ns = 0) {
  uint64_t observed;
  return wait_signal_geq_value(view, signal, expected, peer, phase, &observed, sleep_ns);
}

// Like wait_signal_geq, but the bound counts from start_ns (a global_timer_ns() reading) instead of from the call:
// a thread that waits for several peers in turn shares one deadline between them, so the whole wait is bounded by
// FERRY_TIMEOUT_S, not by (peers x FERRY_TIMEOUT_S).
__device__ __forceinline__ bool wait_signal_geq_since(DeviceView const& view, uint64_t const* signal, uint64_t expected,
                                                      int peer, WaitPhase phase, uint64_t start_ns) {
  uint32_t spins = 0;
  while (true) {
    uint64_t const observed = arch::load_acquire_sys_u64(signal);
    if (observed >= expected) return true;
    if ((++spins & 255u) == 0u) {
      if (device_failed(view)) return stop_waiting(view, peer, observed, expected);
      if (arch::global_timer_ns() - start_ns > view.timeout_ns) {
        record_timeout(view, peer, phase, expected, observed);
        return false;
      }
    }
  }
}

// Sets a flag that publishes no data (nothing written before it needs to be seen with it), e.g. a latency ping-pong.
// Relaxed: skips the release fence a signal_set pays for; never use it to publish rows.
__device__ __forceinline__ void flag_set_relaxed(uint64_t* flag, uint64_t value) {
  arch::store_relaxed_sys_u64(flag, value);
}

// Counts an id the device had to drop (out of range, or a capacity overflow when overflow is true).
__device__ __forceinline__ void record_input_error(DeviceView const& view, int bad_value, bool overflow) {
  if (overflow) {
    atomicAdd(&view.error->overflow_rows, 1u);
  } else if (atomicAdd(&view.error->input_errors, 1u) == 0u) {
    view.error->first_bad_value = bad_value;
  }
}

// Records what a call did not deliver because a capacity was exceeded: `rows` over every rank of the call and the
// lowest rank whose capacity it exceeded. Every rank of the call records the same, found in what every rank reads (the
// count matrix), so that the drop is an error on every rank (docs/errors.md, "Capacities"). Rows and slots of one call
// may be recorded by two kernels: the rank kept is the lowest.
__device__ __forceinline__ void record_call_drops(DeviceView const& view, uint32_t rows, int first_rank) {
  atomicAdd(&view.error->overflow_rows, rows);
  uint32_t const mine = static_cast<uint32_t>(first_rank) + 1u;  // 0: none recorded
  uint32_t seen = view.error->overflow_rank;
  while (seen == 0u || seen > mine) {
    uint32_t const was = atomicCAS(&view.error->overflow_rank, seen, mine);
    if (was == seen) break;
    seen = was;
  }
}

// Counts an expert id outside [-1, num_experts), or a valid id repeated in one topk row, that made this rank refuse
// the call (its abort flag goes into the call's exchange); the reported value is the id clamped to int.
__device__ __forceinline__ void record_bad_expert_id(DeviceView const& view, int64_t id) {
  record_input_error(view, static_cast<int>(id < INT32_MIN ? INT32_MIN : id > INT32_MAX ? INT32_MAX : id), false);
}

// A call this rank joined whose exchange carried `peer`'s abort flag (the peer refused it on input): counted, and the
// first such peer and the phase of its exchange kept; the host raises InputError naming the peer and clears them.
// Every thread that sees a flag may call it: only the first count writes the fields.
__device__ __forceinline__ void record_refusal(DeviceView const& view, int peer, WaitPhase phase) {
  DeviceErrorBlock* block = view.error;
  if (atomicAdd(&block->refusals, 1u) == 0u) {
    block->refusing_rank = peer;
    block->refused_phase = static_cast<int32_t>(phase);
  }
}

// Records that `peer`'s signal in `phase` belongs to call `observed_seq` while this rank runs call `expected_seq`: the
// peer ran more calls of this kind on this buffer than this rank (kErrorOutOfStep; like a timeout it fails the
// communicator). Only the first failure on this rank is kept (as record_timeout), and its waits stop (device_failed).
__device__ __forceinline__ void record_out_of_step(DeviceView const& view, int peer, WaitPhase phase,
                                                   uint64_t expected_seq, uint64_t observed_seq) {
  record_failure(view, kErrorOutOfStep, peer, phase, expected_seq, observed_seq);
}

}  // namespace ferry::device
