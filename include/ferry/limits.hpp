// The bounds of a world that every layer shares (the core layer's: the host's rank sets are sized from them, as are the
// device views). Each is refused where it is met with a ConfigError naming the value and the bound.
#pragma once

namespace ferry {

// Most ranks of one world (128 nodes x 8 GPUs). What is sized from it: DeviceErrorBlock::absent (a bit per rank), the
// barrier slots of the signal area ([0, world) of kSignalSlots), the host's rank sets (RankSet) and the kernels'
// per-source arrays across nodes. The buffers' int32 row indices do not bind it: EpConfig::validate derives the token
// bound from the world (at 1024 ranks and topk 16, 2^17 - 1 tokens per rank still index in int32).
inline constexpr int kMaxWorld = 1024;
// Most ranks of one load/store team (an NVLink domain, NCCL's LSA team; a node on the cpu backend): a SymmetricView
// holds one pointer per rank of the team. Peers outside the team are reached through the network transport.
inline constexpr int kMaxLsaTeam = 32;

// Most ranks of a world that the cuda kernels of one node, normal mode's and rank masking's address: their sets of
// ranks are one 32-bit word, and they keep per-rank arrays of this size in shared memory and in the lsa transport
// (windows by world rank). Low-latency mode's kernels across nodes go up to kMaxWorld (src/ep/cuda/ll/params.cuh
// "Wider worlds"); EpBuffer refuses the rest past this bound at construction (detail::check_cuda_world).
inline constexpr int kMaxCudaWorld = 32;

// The largest topk any path supports.
inline constexpr int kMaxTopk = 16;

}  // namespace ferry
