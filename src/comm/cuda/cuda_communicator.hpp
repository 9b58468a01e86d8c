// What the cuda communicator (cuda_communicator.cu) offers the EP backends past the Communicator interface: which
// transport reaches the peers NVLink does not, and the gin transport over one of its regions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/transport/gin.cuh"
#include "comm/transport/transport.hpp"
#include "ferry/communicator.hpp"

namespace ferry::detail {

// The one place FERRY_NETWORK becomes a transport (the communicator read it at creation, comm/network.hpp): the
// transport the protocols across nodes reach the ranks of other nodes with. gin when `comm` is a cuda communicator
// that set GIN up (FERRY_NETWORK=gin, or auto with peers outside the NVLink team), else emulated (every peer shares
// memory: emulated nodes on one host, FERRY_TOPOLOGY).
transport::Kind network_transport(Communicator const& comm);

// The gin transport over `region` (one of comm's live symmetric regions) whose counters are the window words
// [signals_off, signals_off + 8 * num_signals): the communicator hands the region a range of its GIN signals (reset,
// and given back with the region). Collective: every rank calls it for the same regions in the same order, so the
// ids agree. ConfigError for a communicator without GIN, a region that is not its own, or no free range.
transport::Gin gin_transport(Communicator& comm, SymmetricRegion const& region, std::size_t signals_off,
                             uint32_t num_signals);

}  // namespace ferry::detail
