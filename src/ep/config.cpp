#include <algorithm>
#include <cstdint>

#include "comm/transport/transport.hpp"
#include "ep/ep_impl.hpp"
#include "ep/tuning_key.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"

namespace ferry {

char const* internode_route_name(InternodeRoute route) {
  switch (route) {
    case InternodeRoute::automatic:
      return "automatic";
    case InternodeRoute::forward:
      return "forward";
    case InternodeRoute::direct:
      return "direct";
  }
  return "?";
}

InternodeRoute parse_internode_route(std::string const& name) {
  for (InternodeRoute route : {InternodeRoute::automatic, InternodeRoute::forward, InternodeRoute::direct})
    if (name == internode_route_name(route)) return route;
  FERRY_THROW(ConfigError, "config", "internode_route '", name, "' is unknown; use automatic, forward or direct");
}

InternodeRoute EpConfig::route() const {
  if (mode == Mode::normal) return InternodeRoute::forward;
  if (internode_route != InternodeRoute::automatic) return internode_route;
  return max_tokens_per_rank <= kDirectRouteTokens ? InternodeRoute::direct : InternodeRoute::forward;
}

namespace {
// Most tokens per rank at any world (a rank's own buffers are sized from it).
constexpr int kMaxTokensPerRank = 1 << 20;

// Most tokens per rank at `world` ranks of `topk` entries. NOTE: a rank receives up to world x max_tokens_per_rank
// rows, and the buffers index them, and their topk entries ([rows x topk]: recv_topk_idx, recv_topk_weights), with
// int32; at 256 ranks and topk 16 that leaves 2^19 tokens per rank.
int max_tokens_per_rank_at(int world, int topk) {
  int64_t const entries_per_token = static_cast<int64_t>(world) * std::max(topk, 2);  // recv_src holds 2 per row
  return static_cast<int>(std::min<int64_t>(kMaxTokensPerRank, INT32_MAX / entries_per_token));
}

void validate_geometry(char const* field, std::optional<Geometry> const& geometry) {
  if (!geometry) return;
  FERRY_CHECK_CONFIG(geometry->blocks >= 0, field, ".blocks=", geometry->blocks,
                     " is negative; use 0 (choose) or a CTA count");
}
}  // namespace

void EpConfig::validate(int world) const {
  FERRY_CHECK_CONFIG(world >= 1 && world <= kMaxWorld, "world=", world, " is outside [1, ", kMaxWorld,
                     "] (kMaxWorld), the ranks of one world");
  FERRY_CHECK_CONFIG(hidden > 0, "hidden=", hidden, " must be positive");
  // NOTE: rows move as 16-byte vectors; a bf16 row must be a whole number of them.
  FERRY_CHECK_CONFIG(hidden % 8 == 0, "hidden=", hidden,
                     " is not a multiple of 8 elements (16 bytes of bf16); pad the ",
                     "hidden dimension or use hidden=", (hidden / 8 + 1) * 8);
  for (WireFormat format : {dispatch_format, combine_format}) {
    int const block = wire_block_elems(format);
    // NOTE: every scale block must be whole, so the last block of a row has as many elements as the others.
    FERRY_CHECK_CONFIG(hidden % block == 0, "hidden=", hidden, " is not a multiple of ", block,
                       " elements, the scale block of wire format ", wire_format_name(format),
                       "; use hidden=", (hidden / block + 1) * block, " or another format");
  }
  FERRY_CHECK_CONFIG(num_experts >= 1, "num_experts=", num_experts, " must be at least 1");
  // NOTE: rank r owns experts [r*E/W, (r+1)*E/W); an uneven split has no agreed owner for the remainder.
  FERRY_CHECK_CONFIG(num_experts % world == 0, "num_experts=", num_experts, " is not divisible by the world size ",
                     world, "; experts are split evenly over ranks: use a multiple of ", world, " (e.g. ",
                     (num_experts / world + 1) * world, ")");
  FERRY_CHECK_CONFIG(topk >= 1 && topk <= kMaxTopk, "topk=", topk, " is outside [1, ", kMaxTopk,
                     "], the supported range");
  FERRY_CHECK_CONFIG(topk <= num_experts, "topk=", topk, " is larger than num_experts=", num_experts,
                     "; a token picks distinct experts");
  int const max_tokens = max_tokens_per_rank_at(world, topk);
  FERRY_CHECK_CONFIG(
      max_tokens_per_rank >= 1 && max_tokens_per_rank <= max_tokens, "max_tokens_per_rank=", max_tokens_per_rank,
      " is outside [1, ", max_tokens, "], the most at world=", world, " and topk=", topk,
      " (a rank receives up to world x max_tokens_per_rank rows of topk entries, ", "indexed with int32)");
  if (max_recv_tokens)
    FERRY_CHECK_CONFIG(*max_recv_tokens >= 1, "max_recv_tokens=", *max_recv_tokens, " must be at least 1 (or unset)");
  if (expert_capacity)
    FERRY_CHECK_CONFIG(*expert_capacity >= 1, "expert_capacity=", *expert_capacity, " must be at least 1 (or unset)");
  validate_geometry("dispatch_geometry", dispatch_geometry);
  validate_geometry("combine_geometry", combine_geometry);
  if (mode == Mode::low_latency) {
    // NOTE: low-latency buffers are sized for the worst case (world x max_tokens_per_rank rows landing, as many slots
    // per local expert); past a few hundred tokens that memory is better spent on normal mode's buffers.
    FERRY_CHECK_CONFIG(max_tokens_per_rank <= kMaxLowLatencyTokens, "max_tokens_per_rank=", max_tokens_per_rank,
                       " is more than mode=ll accepts (", kMaxLowLatencyTokens,
                       "); split the decode batch or use mode=normal for larger batches");
    // NOTE: the landing zone holds every row a rank can receive; there is nothing to cap.
    // NOTE: a setting that does nothing is refused, not ignored: both legs run the dispatch grid (the receivers count
    // one arrival per CTA of the sender's grid).
    FERRY_CHECK_CONFIG(!combine_geometry || combine_geometry->blocks == 0,
                       "combine_geometry.blocks=", combine_geometry ? combine_geometry->blocks : 0,
                       " is not used by mode=ll: both legs run one grid, chosen from dispatch_geometry; pin that "
                       "instead, or leave combine_geometry unset");
    FERRY_CHECK_CONFIG(!max_recv_tokens, "max_recv_tokens=", *max_recv_tokens,
                       " is not used by mode=ll (every row is received: the landing zone holds world x "
                       "max_tokens_per_rank rows); leave it unset");
  }
  // NOTE: masking and the wait statistics are built around low-latency mode's per-source waits; normal mode's count
  // exchange lays every row out from every rank's counts, so a rank left out mid-call has no cheap remedy there.
  FERRY_CHECK_CONFIG(!rank_masking || mode == Mode::low_latency,
                     "rank_masking=true needs mode=ll (normal mode fails the call and names the rank that did not "
                     "arrive); use mode=ll or leave rank_masking false");
  FERRY_CHECK_CONFIG(!wait_stats || mode == Mode::low_latency,
                     "wait_stats=true needs mode=ll (it measures the per-source waits of the low-latency receive "
                     "halves); use mode=ll or leave wait_stats false");
  FERRY_CHECK_CONFIG(mode == Mode::low_latency || internode_route != InternodeRoute::direct,
                     "internode_route=direct is a low-latency route; normal mode always forwards across nodes "
                     "(hierarchical): use forward or automatic, or mode=ll");
  FERRY_CHECK_CONFIG(!dispatch_dequantize || dispatch_format != WireFormat::bf16,
                     "dispatch_dequantize=true needs a quantized dispatch_format (got bf16, which is delivered as is); "
                     "set dispatch_format or leave dispatch_dequantize false");
  // NOTE: the scale layout is what the receiver's GEMM reads; a layout that cannot hold the format's scales is a
  // config error even when nothing quantized is delivered yet, so a typo is not silently ignored.
  if (dispatch_format != WireFormat::bf16)
    FERRY_CHECK_CONFIG(scale_layout_supported(dispatch_format, recv_scale_layout),
                       "recv_scale_layout=", scale_layout_name(recv_scale_layout), " cannot hold the scales of ",
                       "dispatch_format=", wire_format_name(dispatch_format),
                       "; see ScaleLayout in ferry/wire_format.hpp for the layouts each format supports");
}

std::size_t EpConfig::recv_row_bytes() const {
  return delivers_quantized() ? wire_payload_bytes(dispatch_format, hidden) : static_cast<std::size_t>(hidden) * 2;
}

EpConfig EpConfig::resolved(int world) const {
  EpConfig out = *this;
  if (mode == Mode::low_latency && !expert_capacity)
    out.expert_capacity = static_cast<int>(static_cast<int64_t>(world) * max_tokens_per_rank);
  return out;
}

int EpConfig::recv_capacity(int world) const {
  int64_t const worst = static_cast<int64_t>(world) * max_tokens_per_rank;
  return static_cast<int>(max_recv_tokens ? std::min<int64_t>(*max_recv_tokens, worst) : worst);
}

namespace detail {

void check_cuda_world(EpConfig const& config, Topology const& topology) {
  // NOTE: one node's kernels and normal mode's keep a set of ranks in one 32-bit word and per-rank arrays of
  // kMaxCudaWorld entries (shared memory, Params, the lsa transport's windows by world rank); low-latency mode's
  // kernels across nodes are sized for kMaxWorld (src/ep/cuda/ll/params.cuh "Wider worlds").
  int const world = topology.world();
  if (world <= kMaxCudaWorld) return;
  bool const ll = config.mode == Mode::low_latency;
  FERRY_CHECK_CONFIG(ll && topology.nodes > 1, "world=", world, " (topology ", topology_name(topology),
                     ") is more than backend cuda's EpBuffer supports in ", ll ? "mode=ll on one node" : "mode=normal",
                     ": ", kMaxCudaWorld,
                     " ranks (those kernels keep a set of ranks in one 32-bit word). Backend cuda takes up to ",
                     kMaxWorld, " ranks in mode=ll across nodes (topology NxM with N > 1); the cpu backend every mode");
  // NOTE: rank masking's kernels keep sets of ranks in ceil(world / 32) words, but past 32 ranks their GPU tests
  // (RankMaskingWide) have not passed yet, so EpBuffer keeps the bound until they do
  FERRY_CHECK_CONFIG(
      !config.rank_masking, "rank_masking with world=", world, " on backend cuda: it runs up to ", kMaxCudaWorld,
      " ranks (its kernels past them are not yet verified on a GPU); turn rank_masking off past them (the "
      "cpu backend masks up to ",
      kMaxWorld, ")");
}

}  // namespace detail

}  // namespace ferry

namespace ferry::detail {

tuning::TuningKey tuning_key(std::string_view gpu, int world, EpConfig const& config) {
  return {tuning::canonical_gpu_name(gpu),
          world,
          config.hidden,
          config.topk,
          wire_format_name(config.dispatch_format),
          wire_format_name(config.combine_format),
          mode_name(config.mode)};
}

}  // namespace ferry::detail
