// The memory an EpBuffer's config holds on each rank, as a function of the config, the world and the backend: the one
// formula the size check of EpBuffer's constructor uses (and what `ferry model` and explain() can report). Every area
// whose size follows a value the user sets (hidden, max_tokens_per_rank, max_recv_tokens, expert_capacity, topk, the
// world and its nodes) is counted at its full size, lazily backed or not; the fixed words of a protocol (counters,
// headers) are left out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"

namespace ferry::detail {

struct MemoryArea {
  char const* name;  // "landing zone", "expert-major layout", ...
  uint64_t bytes;    // saturates at UINT64_MAX
};

struct BufferMemory {
  // The symmetric region of each rank (cpu: a shared-memory segment; cuda: device memory) and this rank's own
  // buffers (cpu: host memory, the expert-major layout mapped lazily; cuda: device memory). Saturating sums.
  uint64_t symmetric = 0;
  uint64_t local = 0;
  std::vector<MemoryArea> areas;  // the areas behind both sums, in the order the backend lays them out
  uint64_t total() const;
  // "66.0 GiB (70866960384 bytes): expert-major layout 64.0 GiB, landing zone 2.0 GiB, ..." (the largest areas)
  std::string describe() const;
};

// What an EpBuffer of `config` (resolved, validated for the world) holds on each rank of `topology` on `backend`.
BufferMemory buffer_memory(EpConfig const& config, Topology const& topology, Backend backend);

// Memory free where a rank's buffers would go, in bytes (UINT64_MAX: not known).
struct FreeMemory {
  uint64_t shared = UINT64_MAX;  // cpu: the shared-memory file system (/dev/shm) of the host
  uint64_t local = UINT64_MAX;   // cpu: physical memory of the host (MemAvailable); cuda: cudaMemGetInfo's free
};
FreeMemory free_memory(Communicator const& comm);

// Whether a rank with `free` free can hold `need` (the cpu backend's ranks share one host: its world's segments and
// buffers count against the host once each); "" when it can, else what is short ("needs 132 GiB of physical memory
// for the 2 ranks of this host (2 x 66.0 GiB), 20.1 GiB (21582352384 bytes) free (MemAvailable)").
std::string memory_shortfall(BufferMemory const& need, FreeMemory const& free, Backend backend, int ranks_on_host);

// "66.0 GiB"
std::string bytes_text(uint64_t bytes);

}  // namespace ferry::detail
