// Backend factories behind Communicator::create.
#pragma once

#include <memory>

#include "comm/device_error.hpp"  // describe_device_error, describe_absent
#include "ferry/communicator.hpp"

namespace ferry::detail {

std::unique_ptr<Communicator> make_cpu_communicator(std::unique_ptr<Bootstrap> bootstrap,
                                                    CommunicatorOptions const& options);
#if FERRY_HAVE_CUDA
std::unique_ptr<Communicator> make_cuda_communicator(std::unique_ptr<Bootstrap> bootstrap,
                                                     CommunicatorOptions const& options);
int cuda_visible_devices();  // cudaGetDeviceCount, 0 on any error (no driver, no device)
#endif

// Bytes of one rank's refusal reason (Communicator::post_refusal), the terminating zero included.
inline constexpr std::size_t kRefusalBytes = 1024;

// The message every peer of a refused call raises (InputError): names the refusing rank and carries its reason.
std::string describe_refusal(int refusing_rank, WaitPhase phase, std::string const& reason);

}  // namespace ferry::detail
