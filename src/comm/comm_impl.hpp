// Backend factories behind Communicator::create.
#pragma once

#include <functional>
#include <memory>
#include <string>

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

// The world's topology, agreed by every rank before anything is built on it (as EpBuffer compares EpConfig).
// Collective, the communicator's first bootstrap exchange. Each rank resolves its own (topology_of over its
// `options_topology`, else its FERRY_TOPOLOGY, else its local world; then `check`, the backend's own bounds, which
// throws ConfigError) and every rank's result is exchanged with how it was set. A rank whose setting is refused raises
// its own ConfigError and every other rank one naming it and its reason; ranks that resolve different topologies
// raise ConfigError on every rank, listing which ranks have which setting. Nobody waits for a rank that gave up.
Topology agree_on_topology(Bootstrap& bootstrap, std::string const& options_topology,
                           std::function<void(Topology const&)> const& check = {});

// A host wait of this rank (cpu backend: a barrier, an exchange of an EpBuffer) was ended by the interrupt check in
// the middle of an exchange: records it in the error block (kErrorInterrupted, the first failure wins) and raises it
// through check_errors, which throws Interrupted and leaves the communicator failed.
[[noreturn]] void fail_interrupted(Communicator& comm, WaitPhase phase);

// Bytes of one rank's refusal reason (Communicator::post_refusal), the terminating zero included.
inline constexpr std::size_t kRefusalBytes = 1024;

// The message of the ids and rows a device dropped (DeviceErrorBlock::input_errors / overflow_rows): what every rank
// of a call that dropped rows raises, naming the rank whose capacity was exceeded (overflow_rank - 1; 0: this rank,
// self). Empty when nothing was dropped.
std::string describe_drops(DeviceErrorBlock const& block, int self);

// The message every peer of a refused call raises (InputError): names the refusing rank and carries its reason.
std::string describe_refusal(int refusing_rank, WaitPhase phase, std::string const& reason);

}  // namespace ferry::detail
