// Backend factories behind Communicator::create.
#pragma once

#include <memory>

#include "ferry/communicator.hpp"

namespace ferry::detail {

std::unique_ptr<Communicator> make_cpu_communicator(std::unique_ptr<Bootstrap> bootstrap,
                                                    CommunicatorOptions const& options);
#if FERRY_HAVE_CUDA
std::unique_ptr<Communicator> make_cuda_communicator(std::unique_ptr<Bootstrap> bootstrap,
                                                     CommunicatorOptions const& options);
int cuda_visible_devices();  // cudaGetDeviceCount, 0 on any error (no driver, no device)
#endif

// The message of a recorded device failure ("rank 0 timed out in phase barrier waiting for rank 1: expected >= 3,
// observed 2 after 30 s"); empty when status is 0.
std::string describe_device_error(DeviceErrorBlock const& block, double timeout_s);
// ...across nodes: the peer is also named by its node and local rank.
std::string describe_device_error(DeviceErrorBlock const& block, double timeout_s, Topology const& topology);

// The ranks a wait found absent, for a timeout's message: "rank(s) 4, 5" and, across nodes, where they are; when
// they are every rank of one node, says that node is absent as a whole (down, or its network unreachable).
std::string describe_absent(std::vector<int> const& missing, Topology const& topology);

// Bytes of one rank's refusal reason (Communicator::post_refusal), the terminating zero included.
inline constexpr std::size_t kRefusalBytes = 1024;

// The message of the ids and rows a device dropped (DeviceErrorBlock::input_errors / overflow_rows): what every rank
// of a call that dropped rows raises, naming the rank whose capacity was exceeded (overflow_rank - 1; 0: this rank,
// self). Empty when nothing was dropped.
std::string describe_drops(DeviceErrorBlock const& block, int self);

// The message every peer of a refused call raises (InputError): names the refusing rank and carries its reason.
std::string describe_refusal(int refusing_rank, WaitPhase phase, std::string const& reason);

}  // namespace ferry::detail
