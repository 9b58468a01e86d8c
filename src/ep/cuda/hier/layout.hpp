// The hierarchical protocol's memory (normal mode across nodes, hier/dispatch.cuh and hier/combine.cuh): its areas of
// the symmetric region past normal mode's (NormalLayout, whose count rows it widens), byte offsets that are the same
// on every rank (hier/layout.cpp lays them out), and its words of the EpBuffer's device state. The rail of node n for
// a rank s of another node is rank n * local + local_of(s). Counters only grow (the network has no remote "set").
// Host and device includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ep/cuda/normal/layout.hpp"
#include "ferry/ep.hpp"
#include "ferry/limits.hpp"

#if defined(__CUDACC__)
#define FERRY_HIER_HD __host__ __device__
#else
#define FERRY_HIER_HD
#endif

namespace ferry::cuda_ep {

// Most count-matrix columns of the hierarchical layout (world destination ranks + nodes).
inline constexpr int kMaxHierColumns = 64;

// A forwarded token's record (hier/dispatch.cuh), next to its row: int32 token, int32 rows[local] (its final row on
// each rank of the rail's node, -1: none), int32 ids[topk] (global, -1: none), float weights[topk]; 16-byte multiple.
FERRY_HIER_HD inline std::size_t hier_record_bytes(int local, int topk) {
  return (static_cast<std::size_t>(1 + local + 2 * topk) * 4 + 15) / 16 * 16;
}

struct HierLayout {
  std::size_t count_send = 0;    // [world destinations][count_words] u64: this rank's count rows (put sources)
  std::size_t count_signal = 0;  // [world sources] u64 counter: +1 per dispatch (its count row is in `counts`)
  std::size_t send_rows = 0;     // [max_tokens] wire rows of this rank's tokens bound for another node
  std::size_t send_meta = 0;     // [nodes][max_tokens] forward records (HierRecord) per destination node
  std::size_t fwd_rows = 0;      // [nodes sources][max_tokens] rows the rail received, compact per source node
  std::size_t fwd_meta = 0;      // [nodes sources][max_tokens] their records (kept for the combine)
  std::size_t fwd_signal = 0;    // [nodes sources] u64 arrival counter (device::kArrivalsPerCall per dispatch)
  std::size_t partials = 0;      // [2 parities][nodes sources][local][max_tokens] bf16 rows to the rail
  std::size_t combine_send = 0;  // [nodes][max_tokens] combine wire rows the rail puts (sources)
  std::size_t arrive = 0;        // [world senders] u64 counter: +1 per combine (rows and abort word are in)
  std::size_t abort = 0;         // [2 parities][world senders] u64: seq if the sender refused that call, else 0
  std::size_t rail_signal = 0;   // [world rails] u64 arrival counter (device::kArrivalsPerCall per combine)
  // The counters above that the network signals (count, fwd, arrive, rail: adjacent, in that order), the GIN
  // transport's signal range; the own node's sources signal the same words by NVLink stores.
  std::size_t signals = 0;
  uint32_t num_signals = 0;
  std::size_t meta_bytes = 0;  // one forward record (hier_record_bytes)
};

// The hierarchical protocol's device words.
struct HierState {
  // The records this rank (a rail) received from each source node in the last dispatch (its combine sends one row
  // back per record).
  int32_t fwd_count[kMaxCudaWorld];
  // What this rank sent to other ranks (EpBuffer::link_bytes, docs/internode.md "Counting the bytes": rows and their
  // metadata, not the control words), [leg: 0 dispatch, 1 combine][0 network bytes, 1 NVLink bytes, 2 network puts of
  // rows]: the running call's sums (its kernels add, its last kernel's last CTA moves them) and the last finished
  // call's.
  unsigned long long bytes_running[2][3];
  unsigned long long bytes[2][3];
};

// The hierarchical areas, appended to `areas` after normal mode's (lay_out_normal without the landing zone), whose
// count rows it replaces by wider ones (a column per node too).
void lay_out_hier(HierLayout& layout, NormalLayout& normal, AreaPacker& areas, EpConfig const& config,
                  Topology const& topology);

}  // namespace ferry::cuda_ep

#undef FERRY_HIER_HD
