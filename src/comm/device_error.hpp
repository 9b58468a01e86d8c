// What a recorded device failure says, in words: for the communicators, which raise it, and for code outside comm/
// that runs kernels over error blocks of its own (ferry p2p's virtual ranks, the tests' virtual ranks), which must
// say it the same way. Implemented in communicator.cpp.
#pragma once

#include <string>
#include <vector>

#include "ferry/communicator.hpp"
#include "ferry/device_view.hpp"

namespace ferry::detail {

// The message of a recorded device failure ("rank 0 timed out in phase barrier waiting for rank 1: expected >= 3,
// observed 2 after 30 s"); empty when status is 0.
std::string describe_device_error(DeviceErrorBlock const& block, double timeout_s);
// ...across nodes: the peer is also named by its node and local rank.
std::string describe_device_error(DeviceErrorBlock const& block, double timeout_s, Topology const& topology);

// The ranks a wait found absent, for a timeout's message: "rank(s) 4, 5" and, across nodes, where they are; when
// they are every rank of one node, says that node is absent as a whole (down, or its network unreachable).
std::string describe_absent(std::vector<int> const& missing, Topology const& topology);

}  // namespace ferry::detail
