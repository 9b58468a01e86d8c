// The symmetric region of one EpBuffer on the cuda backend: each protocol's areas (its folder's layout.hpp) and the
// builder that lays them out for a config (the same on every rank). Host code with no CUDA header, also built without
// the cuda backend: `ferry model` sizes a rank's memory with the same builder the buffers are allocated from.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ep/cuda/hier/layout.hpp"
#include "ep/cuda/ll/layout.hpp"
#include "ep/cuda/normal/layout.hpp"
#include "ep/landing_policy.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "wire/layout.hpp"

#if defined(__CUDACC__)
#define FERRY_LAYOUT_HD __host__ __device__
#else
#define FERRY_LAYOUT_HD
#endif

namespace ferry::cuda_ep {

// Places areas one after another, each starting 256-byte aligned: every row and word area on its own cache lines, and
// 16-byte vectors aligned (the symmetric region's layout, make_sym_layout, and a handle's, make_handle_layout).
class AreaPacker {
 public:
  std::size_t take(std::size_t bytes) {
    std::size_t const at = offset_;
    offset_ = wire::align_up(offset_ + bytes, kAlign);
    return at;
  }
  std::size_t total() const { return offset_; }

 private:
  static constexpr std::size_t kAlign = 256;
  std::size_t offset_ = 0;
};


// Bytes of one landing record (the landing zone of small batches, low-latency mode): topk int32 local ids, then topk
// float weights, padded to 16 bytes.
FERRY_LAYOUT_HD constexpr std::size_t landing_record_bytes(int topk) {
  return (static_cast<std::size_t>(topk) * 8 + 15) / 16 * 16;
}

// Byte offsets inside the symmetric region (the same on every rank; make_sym_layout, buffers.cu): each protocol's own
// areas (its folder's layout.hpp). An EpBuffer runs one protocol; the other protocols' areas stay empty (0).
struct SymLayout {
  NormalLayout normal;  // normal mode (the hierarchical protocol's one-node part too)
  HierLayout hier;      // normal mode across nodes
  LlLayout ll;          // low-latency mode
  int nodes = 1;        // the topology the region was laid out for: nodes, and ranks per node (0 on one node)
  int local = 0;
  std::size_t total = 0;
};

// The symmetric region's layout for a config and protocol (the same on every rank). nodes > 1 (low-latency mode
// across nodes): with the areas the network leg sends from, and the arrival counters as one signal range.
SymLayout make_sym_layout(EpConfig const& config, int world, detail::Protocol protocol, int nodes = 1);
// The symmetric layout of the hierarchical protocol: normal mode's (its count rows a column per node wider) and the
// hierarchical areas.
SymLayout make_hier_sym_layout(EpConfig const& config, Topology const& topology);

}  // namespace ferry::cuda_ep

#undef FERRY_LAYOUT_HD
