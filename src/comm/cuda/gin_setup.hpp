// The cuda communicator's GIN: what the device communicator must be created with for the gin transport, the checks
// that GIN is there (each failure a ConfigError with gin_missing_message: what is missing and how to get it), and the
// Gin a kernel receives. For .cu files (NCCL's device API); docs/gin.md says what each call relies on.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>

#include "comm/transport/gin.cuh"
#include "ferry/communicator.hpp"

namespace ferry::detail {

// GIN signals of the device communicator (ids [0, kGinSignals)), shared by every Gin made from it. NCCL's pool holds
// 64 Ki by default (NCCL_GIN_SIGNAL_POOL_SIZE); 4096 = 32 nodes x 8 local ranks x 16 counters each.
inline constexpr int kGinSignals = 4096;
// GIN contexts asked for: a hint, NCCL decides (ginContextCount of the device communicator).
inline constexpr int kGinContexts = 4;

// Before ncclDevCommCreate: the loaded NCCL must have GIN (2.28.7 or newer) and, where NCCL can say so before the
// device communicator exists (2.29.7 and newer: ncclCommQueryProperties), a GIN backend; then adds GIN's needs
// (connection to every rank, kGinContexts, kGinSignals) to `requirements` (initialized by the caller: zeroed on 2.28,
// NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER from 2.29). Throws ConfigError when GIN is missing.
void add_gin_requirements(ncclComm_t comm, ncclDevCommRequirements& requirements);

// ncclDevCommCreate with requirements that add_gin_requirements filled: NCCL connects GIN here, so a failure (or a
// device communicator without GIN contexts) means GIN is missing: ConfigError with NCCL's own reason in it.
void create_gin_dev_comm(ncclComm_t comm, ncclDevCommRequirements const& requirements, ncclDevComm* out);

// The gin transport over `window` (a region registered with ncclCommWindowRegister: NCCL registers every window of
// a communicator with GIN once GIN is up, the ones registered before included), whose counters are the words
// [signals_off, signals_off + 8 * num_signals) of the window, standing for GIN signals [first_signal, first_signal +
// num_signals). num_signals 0: puts only. ConfigError for a signal range NCCL did not allocate.
transport::Gin make_gin(ncclDevComm const& dev_comm, ncclWindow_t window, char* local_window, std::size_t signals_off,
                        uint32_t first_signal, uint32_t num_signals);

// Sets GIN signals [first, first + count) of `dev_comm` (and their shadows) to zero and waits for it: a range that
// another owner used before starts again from 0. Nobody may signal them meanwhile (NCCL's resetSignal may not race):
// the caller's construction ends in a barrier before any peer's kernel can.
void reset_gin_signals(ncclDevComm const& dev_comm, uint32_t first, uint32_t count);

}  // namespace ferry::detail
