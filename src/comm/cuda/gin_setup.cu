#include "comm/cuda/gin_setup.hpp"

#include <string>

#include "comm/network.hpp"
#include "core/cuda_check.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {
namespace {

struct ResetParams {
  ncclDevComm comm;
  uint32_t first;
  uint32_t count;
};

// A thread per signal, on context 0: NCCL's signals belong to the device communicator, whichever context adds to them
// (docs/gin.md, checklist).
__global__ void reset_signals_kernel(ResetParams const p) {
  uint32_t const i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.count) return;
  ncclGin const gin(p.comm, 0);
  gin.resetSignal(static_cast<ncclGinSignal_t>(p.first + i));
}

[[noreturn]] void gin_missing(int loaded, std::string const& reason) {
  FERRY_THROW(ConfigError, "config", gin_missing_message(loaded, reason));
}

int loaded_nccl_version() {
  int loaded = 0;
  if (ncclGetVersion(&loaded) != ncclSuccess) return 0;
  return loaded;
}

// NCCL's own account of the last failure on `comm` ("GIN not supported.", "No GIN-capable devices found.", ...).
std::string nccl_said(ncclComm_t comm, ncclResult_t result) {
  char const* last = ncclGetLastError(comm);
  std::string said = concat(ncclGetErrorString(result), " (", static_cast<int>(result), ")");
  if (last != nullptr && *last != '\0') said += concat(": \"", last, "\"");
  return said;
}

}  // namespace

void add_gin_requirements(ncclComm_t comm, ncclDevCommRequirements& requirements) {
  // 1. the library: GIN's device API exists from 2.28.7 (the headers are checked by gin.cuh at compile time)
  int const loaded = loaded_nccl_version();
  if (loaded < kGinMinNcclVersion) gin_missing(loaded, "this NCCL has no GIN");

#if NCCL_VERSION_CODE >= 22907
  // 2. a backend on every rank (NCCL agrees on one across the communicator at init)
  ncclCommProperties_t properties = NCCL_COMM_PROPERTIES_INITIALIZER;
  if (ncclResult_t const result = ncclCommQueryProperties(comm, &properties); result != ncclSuccess)
    gin_missing(loaded, concat("ncclCommQueryProperties failed: ", nccl_said(comm, result)));
  if (properties.ginType == NCCL_GIN_TYPE_NONE)
    gin_missing(loaded, "NCCL reports no GIN backend common to every rank (ncclCommQueryProperties: ginType NONE)");
  // 3. connect every rank to every rank (the world team's peers are the seam's)
  requirements.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#else
  // 2. NCCL 2.28 cannot say before the device communicator exists: create_gin_dev_comm finds out
  (void)comm;
  requirements.ginForceEnable = true;
#endif
#if NCCL_VERSION_CODE >= 23100
  // NOTE: Ferry's kernels are compiled ahead of time against these headers, so the device communicator is laid out
  // for the headers' version (requirements.version), not the library's: useRuntimeVersion is for device code that
  // is JIT-compiled against the loaded library.
  requirements.useRuntimeVersion = false;
#endif
  requirements.ginContextCount = kGinContexts;
  requirements.ginSignalCount = kGinSignals;
}

void create_gin_dev_comm(ncclComm_t comm, ncclDevCommRequirements const& requirements, ncclDevComm* out) {
  int const loaded = loaded_nccl_version();
  if (ncclResult_t const result = ncclDevCommCreate(comm, &requirements, out); result != ncclSuccess)
    gin_missing(loaded, concat("ncclDevCommCreate with GIN failed: ", nccl_said(comm, result)));
  // NOTE: the count asked for is a hint; a device communicator with none has no GIN to use
  if (out->ginContextCount == 0 || out->ginSignalCount < kGinSignals) {
    std::string const got =
        concat("the device communicator came with ", static_cast<int>(out->ginContextCount), " GIN contexts and ",
               out->ginSignalCount, " signals (asked for ", kGinContexts, " and ", kGinSignals, ")");
    ncclDevCommDestroy(comm, out);
    gin_missing(loaded, got);
  }
}

transport::Gin make_gin(ncclDevComm const& dev_comm, ncclWindow_t window, char* local_window, std::size_t signals_off,
                        uint32_t first_signal, uint32_t num_signals) {
  FERRY_CHECK_CONFIG(dev_comm.ginContextCount > 0, "make_gin: the device communicator has no GIN contexts");
  FERRY_CHECK_CONFIG(static_cast<int64_t>(first_signal) + num_signals <= dev_comm.ginSignalCount, "make_gin: signals ",
                     first_signal, "..", static_cast<int64_t>(first_signal) + num_signals - 1,
                     " asked for, the device communicator has ", dev_comm.ginSignalCount);
  FERRY_CHECK_CONFIG(signals_off % sizeof(uint64_t) == 0, "make_gin: the signal range starts at ", signals_off,
                     ", not a multiple of 8 bytes");
  transport::Gin gin{};
  gin.comm = dev_comm;
  gin.window = window;
  gin.local_window = local_window;
  gin.signals_off = signals_off;
  gin.first_signal = first_signal;
  gin.num_signals = num_signals;
  gin.num_contexts = static_cast<int32_t>(dev_comm.ginContextCount);
  gin.rank = dev_comm.rank;
  gin.world = dev_comm.nRanks;
  return gin;
}

void reset_gin_signals(ncclDevComm const& dev_comm, uint32_t first, uint32_t count) {
  if (count == 0) return;
  constexpr uint32_t kThreads = 256;
  reset_signals_kernel<<<(count + kThreads - 1) / kThreads, kThreads>>>(ResetParams{dev_comm, first, count});
  FERRY_CHECK_CUDA(cudaGetLastError());
  FERRY_CHECK_CUDA(cudaDeviceSynchronize());
}

}  // namespace ferry::detail
