// Host launchers of the handle copy kernel (normal/handle.cuh): a dispatch handle's storage layout, the save after a
// dispatch and the restore before a combine that refers to an older layout.
#include <algorithm>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/normal/handle.cuh"
#include "ferry/error.hpp"

namespace ferry::cuda_ep {

HandleLayout make_handle_layout(EpConfig const& config, int world, SymLayout const& sym) {
  // NOTE: aligned as the symmetric region's areas: the copy moves 16-byte vectors.
  HandleLayout layout;
  AreaPacker areas;
  std::size_t const rows = static_cast<std::size_t>(config.recv_capacity(world));
  std::size_t const topk = static_cast<std::size_t>(config.topk);
  std::size_t const tokens = static_cast<std::size_t>(config.max_tokens_per_rank);
  layout.recv_idx = areas.take(rows * topk * sizeof(int32_t));
  layout.recv_w = areas.take(rows * topk * sizeof(float));
  layout.recv_src = areas.take(rows * 2 * sizeof(int32_t));
  layout.recv_slot = areas.take(rows * topk * sizeof(int32_t));
  layout.token_mask = areas.take(tokens * sizeof(uint32_t));
  layout.state_words = areas.take(kHandleStateWords * sizeof(int32_t));
  layout.expert_counts = areas.take(static_cast<std::size_t>(config.num_local_experts(world)) * sizeof(int32_t));
  layout.topk_idx = areas.take(tokens * topk * sizeof(int32_t));
  layout.topk_weights = areas.take(tokens * topk * sizeof(float));
  layout.rank_counts = areas.take(static_cast<std::size_t>(world) * world * sizeof(int32_t));
  if (sym.nodes > 1) {
    layout.hier_mask = areas.take(tokens * sizeof(uint32_t));
    layout.hier_fwd_count = areas.take(kMaxCudaWorld * sizeof(int32_t));
    layout.hier_fwd_meta = areas.take(static_cast<std::size_t>(sym.nodes) * tokens * sym.hier.meta_bytes);
  }
  layout.total = areas.total();
  return layout;
}

namespace {

// One direction of the copy: `areas` gets the layout's areas, each from the buffers to the handle (save) or back.
struct LayoutAreas {
  HandleCopyParams& p;
  bool save;
  void add(void* buffer, char* handle, int words_per_row, int rows, bool counted) {
    FERRY_CHECK(p.num_areas < kMaxHandleAreas, "a handle copy of more than ", kMaxHandleAreas, " areas");
    HandleArea& area = p.areas[p.num_areas++];
    area.src = save ? buffer : handle;
    area.dst = save ? static_cast<void*>(handle) : buffer;
    area.words_per_row = words_per_row;
    area.rows = rows;
    area.counted = counted;
  }
};

// The areas every direction copies: what combine and expand read of their dispatch (grep p.state, p.layout,
// token_mask and recv_slot in normal/combine.cuh and normal/expand.cuh): the rank-major metadata of received rows,
// their slots (only when the dispatch expanded: recv_slot is written by expand alone), the source's destination masks
// of its num_tokens tokens, the layout words of DeviceState and the expert counts; across nodes also the senders of
// each token, and as a rail the records it forwarded (all of them: their count is on the device).
void layout_areas(LayoutAreas& areas, Buffers const& b, char* storage, int num_tokens, bool expanded) {
  HandleLayout const hl = make_handle_layout(b.config, b.world, b.layout);
  char* const sym = b.sym.peer(b.rank);
  int const topk = b.config.topk;
  int const cap = b.recv_capacity;
  areas.add(sym + b.layout.normal.recv_idx, storage + hl.recv_idx, topk, cap, true);
  areas.add(sym + b.layout.normal.recv_w, storage + hl.recv_w, topk, cap, true);
  areas.add(sym + b.layout.normal.recv_src, storage + hl.recv_src, 2, cap, true);
  if (expanded) areas.add(b.recv_slot, storage + hl.recv_slot, topk, cap, true);
  areas.add(b.token_mask, storage + hl.token_mask, 1, num_tokens, false);
  areas.add(&b.state->num_recv, storage + hl.state_words, kHandleStateWords, 1, false);
  areas.add(b.expert_counts, storage + hl.expert_counts, b.num_local_experts, 1, false);
  if (b.protocol != Protocol::hierarchical) return;
  FERRY_CHECK(b.layout.hier.meta_bytes % sizeof(uint32_t) == 0, "forward records of ", b.layout.hier.meta_bytes,
              " bytes are not whole words");
  int const records = b.layout.nodes * b.config.max_tokens_per_rank;
  areas.add(b.hier_mask, storage + hl.hier_mask, 1, num_tokens, false);
  areas.add(b.state->hier.fwd_count, storage + hl.hier_fwd_count, kMaxCudaWorld, 1, false);
  areas.add(sym + b.layout.hier.fwd_meta, storage + hl.hier_fwd_meta,
            static_cast<int>(b.layout.hier.meta_bytes / sizeof(uint32_t)), records, false);
}

void launch_copy(Buffers const& b, HandleCopyParams const& p, cudaStream_t stream) {
  // NOTE: a few MB at most: enough CTAs for about 8 vectors per thread, at most one per SM (the copy never waits)
  std::size_t words = static_cast<std::size_t>(p.num_ids);
  for (int a = 0; a < p.num_areas; ++a)
    words += static_cast<std::size_t>(p.areas[a].rows) * static_cast<std::size_t>(p.areas[a].words_per_row);
  std::size_t const per_cta = static_cast<std::size_t>(kThreads) * 32;
  int const ctas = static_cast<int>(
      std::clamp<std::size_t>((words + per_cta - 1) / per_cta, 1, static_cast<std::size_t>(std::max(1, b.num_sms))));
  handle_copy_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(p);
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void launch_save_handle(Buffers const& b, void* storage, DispatchArgs const& args, bool expanded, cudaStream_t stream) {
  FERRY_CHECK(b.protocol != Protocol::ll, "a dispatch handle of a low-latency buffer");
  FERRY_CHECK(storage != nullptr, "a handle without storage");
  FERRY_CHECK(args.num_tokens >= 0 && args.num_tokens <= b.config.max_tokens_per_rank, "num_tokens=", args.num_tokens,
              " is outside [0, max_tokens_per_rank=", b.config.max_tokens_per_rank, "]");
  FERRY_CHECK(args.num_tokens == 0 || (args.topk_idx && args.topk_weights), "a saved dispatch without ids");
  HandleLayout const hl = make_handle_layout(b.config, b.world, b.layout);
  char* const base = static_cast<char*>(storage);
  int const topk = b.config.topk;
  HandleCopyParams p{};
  LayoutAreas areas{p, true};
  layout_areas(areas, b, base, args.num_tokens, expanded);
  if (args.num_tokens > 0)
    areas.add(const_cast<float*>(args.topk_weights), base + hl.topk_weights, topk, args.num_tokens, false);
  p.num_rows = &b.state->num_recv;
  p.ids = args.topk_idx;
  p.ids_64 = args.topk_idx_type == IndexType::int64;
  p.ids_dst = reinterpret_cast<int32_t*>(base + hl.topk_idx);
  p.num_ids = args.num_tokens * topk;
  if (b.protocol != Protocol::landing) {  // the landing zone exchanges no count matrix
    p.counts = reinterpret_cast<uint64_t const*>(b.sym.peer(b.rank) + b.layout.normal.counts);
    p.seq = &b.state->normal.dispatch_seq;
    p.count_words = b.layout.normal.count_words;
    p.world = b.world;
    p.counts_dst = reinterpret_cast<int32_t*>(base + hl.rank_counts);
  }
  launch_copy(b, p, stream);
}

void launch_received_copy(Buffers const& b, detail::EpBackendImpl::CopyPlan const& plan, cudaStream_t stream) {
  HandleCopyParams p{};
  for (int a = 0; a < plan.num_areas; ++a) {
    detail::EpBackendImpl::CopyPlan::Area const& area = plan.areas[a];
    FERRY_CHECK(area.bytes % sizeof(uint32_t) == 0, "a copy of ", area.bytes, " bytes is not whole words");
    FERRY_CHECK(area.bytes / sizeof(uint32_t) <= INT32_MAX, "a copy of ", area.bytes, " bytes");
    // one row of every word: the rows of the copy are the caller's, not a count on the device
    p.areas[p.num_areas++] = {area.src, area.dst, static_cast<int>(area.bytes / sizeof(uint32_t)), 1, false};
  }
  p.num_rows = &b.state->num_recv;  // read but unused: no area is counted
  p.ids = plan.ids;
  p.ids_64 = false;
  p.widen = plan.ids_64;
  p.ids_dst = plan.ids_dst;
  p.num_ids = static_cast<int>(plan.num_ids);
  if (p.num_areas == 0 && p.num_ids == 0) return;
  launch_copy(b, p, stream);
}

void launch_restore_handle(Buffers const& b, void const* storage, int num_tokens, bool expanded, cudaStream_t stream) {
  FERRY_CHECK(b.protocol != Protocol::ll, "a dispatch handle of a low-latency buffer");
  FERRY_CHECK(storage != nullptr, "a handle without storage");
  FERRY_CHECK(num_tokens >= 0 && num_tokens <= b.config.max_tokens_per_rank, "num_tokens=", num_tokens,
              " is outside [0, max_tokens_per_rank=", b.config.max_tokens_per_rank, "]");
  HandleLayout const hl = make_handle_layout(b.config, b.world, b.layout);
  // the kernel only reads the handle's storage in this direction
  char* const base = const_cast<char*>(static_cast<char const*>(storage));
  HandleCopyParams p{};
  LayoutAreas areas{p, false};
  layout_areas(areas, b, base, num_tokens, expanded);
  p.num_rows = reinterpret_cast<int32_t const*>(base + hl.state_words);  // the saved num_recv (first word)
  launch_copy(b, p, stream);
}

}  // namespace ferry::cuda_ep
