// Synthetic trace buffers with a known content, for the decoder's tests and `ferry trace --selftest`.
#pragma once

#include <cstdint>

#include "ferry/trace.hpp"

namespace ferry::trace {

// A full buffer of `kernel`: every warp records capacity events, pairs (begin, end) of the kernel's slots in turn,
// each span span_ns long with gap_ns between spans; warp w starts at start_ns + w * skew_ns. An odd capacity leaves
// the last begin without its end.
TraceBuffer synthetic_trace(int rank, TraceKernel kernel, int ctas, int warps_per_cta, int capacity, int64_t start_ns,
                            int64_t span_ns = 100, int64_t gap_ns = 10, int64_t skew_ns = 1);

}  // namespace ferry::trace
