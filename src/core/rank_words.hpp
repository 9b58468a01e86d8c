// A set of ranks kept as 32-bit words, as the cuda kernels keep a token's destinations across nodes (token_mask):
// rank d is bit d % 32 of word d / 32. Host and device includable (no CUDA header), so the host's unit tests check
// what the kernels compute.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FERRY_RANK_WORDS_HD __host__ __device__
#else
#define FERRY_RANK_WORDS_HD
#endif

namespace ferry::detail {

// Words that hold a set of `world` ranks.
FERRY_RANK_WORDS_HD constexpr int rank_words(int world) {
  return (world + 31) / 32;
}

// The `local` ranks [first, first + local) of a set as one word, bit l for rank first + l (local <= 32). word(i) is
// the set's i-th word, 0 past its last: a node's ranks may straddle two words.
template <typename Word>
FERRY_RANK_WORDS_HD inline uint32_t ranks_of_node(Word const& word, int first, int local) {
  uint64_t const two = word(first / 32) | static_cast<uint64_t>(word(first / 32 + 1)) << 32;
  uint32_t const low = local >= 32 ? ~0u : (1u << local) - 1u;
  return static_cast<uint32_t>(two >> (first % 32)) & low;
}

}  // namespace ferry::detail

#undef FERRY_RANK_WORDS_HD
