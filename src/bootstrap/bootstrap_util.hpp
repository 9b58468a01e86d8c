// Pieces shared by the bootstrap implementations: what a collective call is (to match the calls of all ranks) and
// how errors describe calls, ranks and durations.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::detail {

// Values travel on the wire (socket bootstrap): never renumber, only add.
enum class BootstrapOp : uint32_t {
  kAllgather = 1,
  kBroadcast = 2,
  kBarrier = 3,
};

// One collective call as the caller made it; every rank's n-th call must be equal.
struct BootstrapOpDesc {
  BootstrapOp op = BootstrapOp::kBarrier;
  std::size_t bytes = 0;
  int root = -1;  // broadcast only; -1 otherwise

  bool operator==(BootstrapOpDesc const&) const = default;
};

// "allgather of 8 bytes per rank", "broadcast of 16 bytes from root 2", "barrier".
std::string describe(BootstrapOpDesc const& desc);
// "rank 3", "ranks 1, 3".
std::string describe_ranks(std::vector<int> const& ranks);
// "2 s", "1.5 s", "250 ms".
std::string describe_duration(std::chrono::milliseconds duration);

}  // namespace ferry::detail
