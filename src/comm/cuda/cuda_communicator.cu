// The cuda backend of Communicator: NCCL's device API (symmetric windows, LSA pointers over NVLink; GIN for the peers
// outside the NVLink team, or when FERRY_NETWORK asks for it), a host-visible error block, and a bounded device
// barrier over Ferry's own signal area (a host barrier where some peer is reached only through the network).
#include <cuda.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm_impl.hpp"
#include "comm/cuda/cuda_communicator.hpp"
#include "comm/cuda/gin_setup.hpp"
#include "comm/device/barrier.cuh"
#include "comm/network.hpp"
#include "core/cuda_check.hpp"
#include "core/launcher.hpp"
#include "core/log.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

// NOTE: written against the device API of 2.28 and of 2.29 and newer (which added
// NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER and the size/magic/version words it fills); scripts/check-gin-headers.sh
// compiles this file against the newest.
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < 22807
#error "Ferry's cuda backend needs NCCL's device API with GIN: NCCL 2.28.7 or newer headers (FERRY_NCCL_ROOT)"
#endif

namespace ferry::detail {
namespace {

// ---- kernels ------------------------------------------------------------------------------------------------------

struct LsaPointerParams {
  ncclWindow_t window;
  int lsa_size;  // ranks of this rank's NVLink team (<= kMaxLsaTeam)
  char** out;    // lsa_size entries, device memory
};

// One thread per rank of the NVLink team reads the window's flat LSA address of that rank (its LSA rank: its world
// rank minus the team's first). The window struct lives in device memory, so this is the only way to learn the
// addresses; they are fixed for the window's lifetime.
__global__ void fetch_lsa_pointers_kernel(LsaPointerParams const params) {
  int const lsa_rank = static_cast<int>(threadIdx.x);
  if (lsa_rank >= params.lsa_size) return;
  params.out[lsa_rank] = static_cast<char*>(ncclGetLsaPointer(params.window, 0, lsa_rank));
}

struct RefusalPutParams {
  transport::Gin gin;  // over the refusal region, no signals
  int rank;
  int world;
  int lsa_first;
  int lsa_size;
};

// One warp: this rank's reason (slot 0 of its refusal region) into slot 1 + rank of every rank outside its NVLink
// team, which cannot read it by load/store. Context 0, the one the protocols' count rows go on: their strong signal
// covers this earlier put to the same peer, so a peer that saw the abort flag finds the text (docs/gin.md).
__global__ void put_refusal_kernel(RefusalPutParams const p) {
  auto net = p.gin.open(transport::Warp{}, 0);
  for (int peer = 0; peer < p.world; ++peer)
    if (peer < p.lsa_first || peer >= p.lsa_first + p.lsa_size)
      net.put(peer, kRefusalBytes * (1 + static_cast<std::size_t>(p.rank)), 0, kRefusalBytes);
  net.flush();
  net.close();
}

struct BarrierParams {
  DeviceView view;
};

// The whole grid is one thread: barrier_ranks needs exactly one caller per rank.
__global__ void barrier_kernel(BarrierParams const params) {
  device::barrier_ranks(params.view, WaitPhase::barrier);
}

// ---- helpers ------------------------------------------------------------------------------------------------------

std::string nccl_version_text(int code) {
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return concat(code / 10000, ".", (code / 100) % 100, ".", code % 100, " (", code, ")");
}

std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// cuMemGetAllocationGranularity through the runtime's driver entry point: linking libcuda directly would stop every
// Ferry binary from starting on a machine without a driver (CI runs the GPU tests there, and they must skip).
using MemGetAllocationGranularityFn = CUresult (*)(std::size_t*, CUmemAllocationProp const*,
                                                   CUmemAllocationGranularity_flags);

MemGetAllocationGranularityFn driver_mem_get_allocation_granularity() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  FERRY_CHECK_CUDA(
      cudaGetDriverEntryPointByVersion("cuMemGetAllocationGranularity", &fn, 12000, cudaEnableDefault, &status));
  FERRY_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr,
              "the CUDA driver does not provide cuMemGetAllocationGranularity (query status ", static_cast<int>(status),
              "); update the NVIDIA driver to one that supports CUDA 12 or newer");
  return reinterpret_cast<MemGetAllocationGranularityFn>(fn);
}

// Teardown cannot throw: failures are logged (FERRY_LOG) and the rest of the teardown goes on.
void log_teardown(int rank, char const* step, char const* what) noexcept {
  try {
    FERRY_LOG_ERROR("cuda communicator teardown (rank ", rank, "): ", step, " failed: ", what);
  } catch (...) {
  }
}

// ---- the communicator ---------------------------------------------------------------------------------------------

class CudaCommunicator final : public Communicator {
 public:
  explicit CudaCommunicator(std::unique_ptr<Bootstrap> bootstrap) : bootstrap_(std::move(bootstrap)) {}
  ~CudaCommunicator() override { teardown(); }

  CudaCommunicator(CudaCommunicator const&) = delete;
  CudaCommunicator& operator=(CudaCommunicator const&) = delete;

  void init(CommunicatorOptions const& options);

  Backend backend() const override { return Backend::cuda; }
  Bootstrap& bootstrap() const override { return *bootstrap_; }
  int device() const override { return device_; }
  Topology const& topology() const override { return topology_; }
  bool load_store_reachable(int peer) const override { return peer >= lsa_first_ && peer < lsa_first_ + lsa_size_; }
  DeviceView const& device_view() const override { return view_; }

  SymmetricRegion alloc_symmetric(std::size_t bytes) override {
    ensure_usable();
    FERRY_CHECK_CONFIG(bytes > 0, "alloc_symmetric(0): ask for at least one byte");
    return alloc_region(bytes);
  }
  void release_symmetric(SymmetricRegion const& region) noexcept override;
  void post_refusal(std::string const& reason) override;
  std::string refusal_of(int rank) override;

  void check_errors(cudaStream_t stream) override;
  bool failed() const override { return failed_; }
  bool has_gin() const { return gin_; }
  transport::Gin gin_transport(SymmetricRegion const& region, std::size_t signals_off, uint32_t num_signals);
  void ensure_usable() const override {
    if (failed_) FERRY_THROW(Error, "ferry", "communicator failed earlier: ", failure_, "; create a new communicator");
    bootstrap_->check_alive();  // a job stopped by its bootstrap (two jobs on one port) stops its calls too
  }

  void barrier(cudaStream_t stream) override {
    ensure_usable();
    FERRY_CHECK_CUDA(cudaSetDevice(device_));
    if (lsa_size_ < bootstrap_->world()) {
      // NOTE: the device barrier stores into every peer's signal area, which the ranks of other nodes do not map:
      // the stream's work, then the bootstrap's barrier (the host waits; bounded by the bootstrap's timeout)
      FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
      bootstrap_->barrier();
      return;
    }
    barrier_kernel<<<1, 1, 0, stream>>>(BarrierParams{view_});
    FERRY_CHECK_CUDA(cudaGetLastError());
  }

 private:
  struct Region {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    ncclWindow_t window = nullptr;
    uint64_t id = 0;        // allocation number, the same on every rank (allocations are collective and ordered)
    bool released = false;  // given back by its owner (release_symmetric); reused or freed by the next allocation
    SymmetricRegion view{};
  };

  SymmetricRegion alloc_region(std::size_t bytes);
  // Collective, at the start of every allocation: the regions every rank has released. One that fits `bytes` is
  // returned (zeroed) for reuse; the others are deregistered and freed (collective, in id order on every rank).
  std::optional<SymmetricRegion> recycle_released(std::size_t bytes);
  void teardown() noexcept;

  std::unique_ptr<Bootstrap> bootstrap_;
  int device_ = -1;
  ncclComm_t comm_ = nullptr;
  ncclDevComm dev_comm_{};
  bool dev_comm_created_ = false;
  bool gin_ = false;                         // dev_comm_ has GIN (FERRY_NETWORK)
  SignalRanges signal_ranges_{kGinSignals};  // dev_comm_'s GIN signals, by the id of the region that holds them
  std::vector<Region> regions_;              // in allocation order; released in reverse
  uint64_t next_region_id_ = 0;
  // [1 + world] x kRefusalBytes: slot 0 this rank's reason for its last refused call (peers of its NVLink team read it
  // there), slot 1 + s the reason of rank s outside the team (put over GIN by post_refusal)
  SymmetricRegion refusals_{};
  transport::Gin refusal_gin_{};  // with GIN: puts into refusals_ of the ranks outside the NVLink team
  std::size_t alignment_ = NCCL_WIN_REQUIRED_ALIGNMENT;
  DeviceErrorBlock* error_host_ = nullptr;  // mapped pinned memory; view_.error is its device address
  uint64_t* barrier_epoch_ = nullptr;
  char** pointer_scratch_ = nullptr;
  double timeout_s_ = 30;
  DeviceView view_{};
  bool initialized_ = false;
  Topology topology_;
  int lsa_first_ = 0;  // this rank's NVLink team: world ranks [lsa_first_, lsa_first_ + lsa_size_)
  int lsa_size_ = 0;
  bool failed_ = false;
  std::string failure_;
};

void CudaCommunicator::init(CommunicatorOptions const& options) {
  // 1. NVLink multicast stays off in this process before NCCL reads its environment (DESIGN "Safety").
  set_multicast_safety_env();
  int const rank = bootstrap_->rank();
  int const world = bootstrap_->world();
  // NOTE: DeviceView carries a pointer per rank of the NVLink team (checked against kMaxLsaTeam below); the world
  // past it is reached through the network. (EpBuffer's kernels address at most kMaxCudaWorld ranks: check_cuda_world.)
  FERRY_CHECK_CONFIG(world >= 1 && world <= kMaxWorld, "world=", world, " is outside [1, ", kMaxWorld,
                     "] (kMaxWorld), the ranks of one world");
  timeout_s_ = env_double("FERRY_TIMEOUT_S");  // its rule (positive) is the env table's
  topology_ = agree_on_topology(*bootstrap_, options.topology);

  // 2. the GPU of this rank
  int num_devices = 0;
  FERRY_CHECK_CUDA(cudaGetDeviceCount(&num_devices));
  device_ = options.device >= 0 ? options.device : bootstrap_->local_rank();
  FERRY_CHECK_CONFIG(device_ < num_devices, "rank ", rank, " wants GPU ", device_, " but only ", num_devices,
                     " are visible; start at most one rank per GPU or fix CUDA_VISIBLE_DEVICES / LOCAL_RANK");
  FERRY_CHECK_CUDA(cudaSetDevice(device_));

  // 3. the loaded NCCL must be the one whose headers we compiled against.
  // NOTE: the device structs (ncclDevComm, the window struct embedded in it, ncclDevCommRequirements) change inside
  // a minor series (2.28.9 inserted barrierCount before lsaBarrierCount): a mismatch corrupts memory silently.
  int loaded = 0;
  FERRY_CHECK_NCCL(ncclGetVersion(&loaded));
  if (loaded != NCCL_VERSION_CODE && env_int("FERRY_NCCL_VERSION_CHECK") != 0) {
    FERRY_THROW(NcclError, "nccl", "the loaded NCCL is ", nccl_version_text(loaded),
                " but Ferry was compiled against NCCL headers ", nccl_version_text(NCCL_VERSION_CODE),
                "; NCCL's device structs change inside a minor series, so the mix would corrupt memory silently. "
                "Load the matching libnccl.so.2 (LD_LIBRARY_PATH, or import torch first) or rebuild Ferry with "
                "FERRY_NCCL_ROOT pointing at the loaded NCCL; FERRY_NCCL_VERSION_CHECK=0 skips this check at your "
                "own risk");
  }

  // 4. the NCCL communicator: rank 0's unique id travels through the bootstrap
  ncclUniqueId id{};
  if (rank == 0) FERRY_CHECK_NCCL(ncclGetUniqueId(&id));
  bootstrap_->broadcast(&id, sizeof(id), 0);
  FERRY_CHECK_NCCL(ncclCommInitRank(&comm_, world, id, rank));

  // 5. the NVLink team (the ranks this one reaches by load/store), and whether the peers outside it (if any) are
  // to be reached over GIN
  ncclTeam_t const lsa = ncclTeamLsa(comm_);
  lsa_size_ = lsa.nRanks;
  lsa_first_ = rank - lsa.rank;
  // NOTE: SymmetricView holds one pointer per rank of the team; a larger NVLink domain (e.g. NVL72) needs a larger
  // kMaxLsaTeam, whose cost is every kernel's Params.
  FERRY_CHECK_CONFIG(lsa_size_ <= kMaxLsaTeam, "rank ", rank, "'s NVLink team has ", lsa_size_,
                     " ranks, more than the ", kMaxLsaTeam,
                     " (kMaxLsaTeam) that a SymmetricView holds pointers for; start at most ", kMaxLsaTeam,
                     " ranks per NVLink domain");
  Network const network = parse_network(env_string("FERRY_NETWORK"));
  gin_ = wants_gin(network, world, lsa.nRanks);
  FERRY_CHECK_CONFIG(gin_ || lsa.nRanks == world, "only ", lsa.nRanks, " of ", world,
                     " ranks share load/store access (NVLink) with rank ", rank, " (topology ",
                     topology_name(topology_), ") and FERRY_NETWORK=", network_name(network),
                     " leaves out the network (GIN); run all ranks on one NVLink-connected host");
  check_node_in_team(topology_, rank, lsa_first_, lsa_size_);

  // 6. the device communicator, with GIN's contexts and signals when asked for (a ConfigError saying what is missing
  // where GIN is not there). NOTE: never lsaMultimem: NVLink multicast can take the host's GPUs out of service.
#if defined(NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER)
  ncclDevCommRequirements requirements = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements requirements;
  std::memset(&requirements, 0, sizeof(requirements));  // 2.28 has no initializer macro; zero means "none"
#endif
  requirements.lsaBarrierCount = 1;
  if (gin_) {
    add_gin_requirements(comm_, requirements);
    create_gin_dev_comm(comm_, requirements, &dev_comm_);
  } else {
    FERRY_CHECK_NCCL(ncclDevCommCreate(comm_, &requirements, &dev_comm_));
  }
  dev_comm_created_ = true;

  // 7. allocation granularity of symmetric memory (ncclMemAlloc uses cuMem with the recommended granularity)
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::size_t granularity = 0;
  FERRY_CHECK_CU(driver_mem_get_allocation_granularity()(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  alignment_ = std::max<std::size_t>(granularity, NCCL_WIN_REQUIRED_ALIGNMENT);

  // 8. host-visible error block, barrier epoch, scratch for pointer fetches
  FERRY_CHECK_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(DeviceErrorBlock), cudaHostAllocMapped));
  std::memset(error_host_, 0, sizeof(DeviceErrorBlock));
  DeviceErrorBlock* error_device = nullptr;
  FERRY_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device), error_host_, 0));
  FERRY_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&barrier_epoch_), sizeof(uint64_t)));
  FERRY_CHECK_CUDA(cudaMemset(barrier_epoch_, 0, sizeof(uint64_t)));
  FERRY_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&pointer_scratch_), kMaxLsaTeam * sizeof(char*)));

  // 9. the signal area: kSignalSlots words per rank, zeroed (barrier epochs start at 0)
  SymmetricRegion const signals = alloc_region(kSignalSlots * sizeof(uint64_t));

  view_.rank = rank;
  view_.world = world;
  view_.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
  view_.error = error_device;
  view_.signals = signals.view;
  view_.barrier_epoch = barrier_epoch_;
  refusals_ = alloc_region(kRefusalBytes * (1 + static_cast<std::size_t>(world)));
  if (gin_) refusal_gin_ = gin_transport(refusals_, 0, 0);
  initialized_ = true;
}

transport::Gin CudaCommunicator::gin_transport(SymmetricRegion const& region, std::size_t signals_off,
                                               uint32_t num_signals) {
  FERRY_CHECK_CONFIG(gin_,
                     "this cuda communicator has no GIN: create it with FERRY_NETWORK=gin, or across nodes with "
                     "FERRY_NETWORK=auto");
  for (Region const& r : regions_) {
    if (r.ptr != region.local || r.ptr == nullptr || r.released) continue;
    FERRY_CHECK_CONFIG(signals_off % sizeof(uint64_t) == 0 && signals_off + num_signals * sizeof(uint64_t) <= r.bytes,
                       "gin_transport: the signal words [", signals_off, ", ", signals_off + num_signals * 8,
                       ") are not 8-byte words inside the region's ", r.bytes, " bytes");
    uint32_t const first = signal_ranges_.take(r.id, num_signals);
    reset_gin_signals(dev_comm_, first, num_signals);
    return make_gin(dev_comm_, r.window, static_cast<char*>(r.ptr), signals_off, first, num_signals);
  }
  FERRY_THROW(ConfigError, "config", "gin_transport: the region at ", region.local,
              " is not a live symmetric region of this communicator");
}

void CudaCommunicator::release_symmetric(SymmetricRegion const& region) noexcept {
  // Local: deregistering a window is collective, and a destructor cannot wait for peers that may be gone. The region
  // is freed or handed out again by the next collective allocation, once every rank has released it.
  for (Region& r : regions_)
    if (r.ptr == region.local && r.ptr != nullptr) r.released = true;
}

void CudaCommunicator::post_refusal(std::string const& reason) {
  // Written (synchronously) before the refused call's kernels are enqueued: a peer that saw this rank's abort flag
  // in that call reads it afterwards (refusal_of), when its own kernel has finished. The ranks outside the NVLink
  // team get it over GIN, ahead of the call's count rows on the same context.
  char text[kRefusalBytes] = {};
  std::memcpy(text, reason.data(), std::min(reason.size(), kRefusalBytes - 1));
  FERRY_CHECK_CUDA(cudaSetDevice(device_));
  FERRY_CHECK_CUDA(cudaMemcpy(refusals_.local, text, kRefusalBytes, cudaMemcpyHostToDevice));
  if (lsa_size_ == bootstrap_->world()) return;
  RefusalPutParams params{};
  params.gin = refusal_gin_;
  params.rank = bootstrap_->rank();
  params.world = bootstrap_->world();
  params.lsa_first = lsa_first_;
  params.lsa_size = lsa_size_;
  put_refusal_kernel<<<1, 32>>>(params);
  FERRY_CHECK_CUDA(cudaGetLastError());
  FERRY_CHECK_CUDA(cudaDeviceSynchronize());
}

std::string CudaCommunicator::refusal_of(int rank) {
  FERRY_CHECK(rank >= 0 && rank < bootstrap_->world(), "refusal_of(", rank, "): no such rank in a world of ",
              bootstrap_->world());
  char text[kRefusalBytes] = {};
  FERRY_CHECK_CUDA(cudaSetDevice(device_));
  // the peer's copy through its LSA address (a flat address on this device), or what it put here over GIN
  char const* const from = load_store_reachable(rank)
                               ? refusals_.view.peer(rank)
                               : static_cast<char const*>(refusals_.local) + kRefusalBytes * (1 + rank);
  FERRY_CHECK_CUDA(cudaMemcpy(text, from, kRefusalBytes, cudaMemcpyDeviceToHost));
  return std::string(text, strnlen(text, kRefusalBytes));
}

std::optional<SymmetricRegion> CudaCommunicator::recycle_released(std::size_t bytes) {
  // 1. every rank's released ids (two rounds: how many, then the ids, padded to the longest list)
  int const world = bootstrap_->world();
  std::vector<uint64_t> mine;
  for (Region const& r : regions_)
    if (r.released) mine.push_back(r.id);
  uint64_t const count = mine.size();
  std::vector<uint64_t> counts(world);
  bootstrap_->allgather(&count, counts.data(), sizeof(uint64_t));
  uint64_t const longest = *std::max_element(counts.begin(), counts.end());
  if (longest == 0) return std::nullopt;
  mine.resize(longest, UINT64_MAX);
  std::vector<uint64_t> all(static_cast<std::size_t>(world) * longest);
  bootstrap_->allgather(mine.data(), all.data(), longest * sizeof(uint64_t));

  // 2. the ids released on every rank (the same set everywhere, so every rank takes the same decisions below)
  std::vector<uint64_t> common;
  for (std::size_t i = 0; i < longest; ++i) {  // rank 0's list: an id released everywhere is in it
    uint64_t const id = all[i];
    if (id == UINT64_MAX) continue;
    bool everywhere = true;
    for (int r = 1; r < world && everywhere; ++r)
      everywhere =
          std::find(all.begin() + r * longest, all.begin() + (r + 1) * longest, id) != all.begin() + (r + 1) * longest;
    if (everywhere) common.push_back(id);
  }
  std::sort(common.begin(), common.end());
  if (common.empty()) return std::nullopt;

  // 3. reuse the smallest that fits (its size is the same on every rank), free the others
  std::size_t const rounded = round_up(bytes, alignment_);
  auto const find = [this](uint64_t id) {
    return std::find_if(regions_.begin(), regions_.end(), [id](Region const& x) { return x.id == id; });
  };
  std::optional<uint64_t> reuse;
  std::size_t reuse_bytes = SIZE_MAX;
  for (uint64_t id : common) {
    std::size_t const have = find(id)->bytes;
    // NOTE: a region more than twice the size asked for is freed rather than kept half empty
    if (have >= rounded && have <= 2 * rounded && have < reuse_bytes) {
      reuse = id;
      reuse_bytes = have;
    }
  }
  // every rank's kernels on these regions finished before it released them; the peers' too before this allocation
  // (each released before calling it), so nobody reaches them any more
  FERRY_CHECK_CUDA(cudaDeviceSynchronize());
  std::optional<SymmetricRegion> out;
  for (uint64_t id : common) {
    auto const it = find(id);
    signal_ranges_.give_back(id);  // a reused region's new owner asks for its signals again
    if (reuse && id == *reuse) {
      FERRY_CHECK_CUDA(cudaMemset(it->ptr, 0, it->bytes));
      FERRY_CHECK_CUDA(cudaDeviceSynchronize());
      it->released = false;
      out = it->view;
      continue;
    }
    FERRY_CHECK_NCCL(ncclCommWindowDeregister(comm_, it->window));
    FERRY_CHECK_NCCL(ncclMemFree(it->ptr));
    regions_.erase(it);
  }
  // NOTE: a reused region's zeroes must land on every rank before a peer's next kernel can write into it: the
  // caller's construction ends in a barrier before any kernel runs (EpBuffer's backends do), as for a new region.
  return out;
}

SymmetricRegion CudaCommunicator::alloc_region(std::size_t bytes) {
  int const rank = bootstrap_->rank();
  int const world = bootstrap_->world();
  FERRY_CHECK_CUDA(cudaSetDevice(device_));

  // 1. every rank must ask for the same size (the window is collective and symmetric)
  std::vector<uint64_t> sizes(world);
  uint64_t const mine = bytes;
  bootstrap_->allgather(&mine, sizes.data(), sizeof(uint64_t));
  for (int r = 0; r < world; ++r) {
    FERRY_CHECK_CONFIG(sizes[r] == mine, "alloc_symmetric is collective with equal sizes, but rank ", rank,
                       " asked for ", mine, " bytes and rank ", r, " for ", sizes[r],
                       "; call it in the same order with the same size on every rank");
  }

  // 2. reuse a region every rank has released, if one fits (and free the other released ones)
  if (std::optional<SymmetricRegion> recycled = recycle_released(bytes)) return *recycled;

  // 3. allocate, zero, register (collective, same order on every rank)
  Region region;
  region.id = next_region_id_++;
  region.bytes = round_up(bytes, alignment_);
  FERRY_CHECK_NCCL(ncclMemAlloc(&region.ptr, region.bytes));
  try {
    FERRY_CHECK_CUDA(cudaMemset(region.ptr, 0, region.bytes));
    // Zeroes must land before any peer can reach the window (registration below is where peers learn of it).
    FERRY_CHECK_CUDA(cudaDeviceSynchronize());
    FERRY_CHECK_NCCL(ncclCommWindowRegister(comm_, region.ptr, region.bytes, &region.window, NCCL_WIN_COLL_SYMMETRIC));
  } catch (...) {
    ncclMemFree(region.ptr);
    throw;
  }
  regions_.push_back(region);

  // 4. the NVLink team's flat LSA addresses, fetched once (LSA rank = world rank - lsa_first_). NCCL maps all
  // ranks' memory into one flat range, so the view's pointer of this rank is a second virtual address of its buffer,
  // not region.ptr itself; both are valid on this device.
  LsaPointerParams params{};
  params.window = region.window;
  params.lsa_size = lsa_size_;
  params.out = pointer_scratch_;
  fetch_lsa_pointers_kernel<<<1, kMaxLsaTeam>>>(params);
  FERRY_CHECK_CUDA(cudaGetLastError());
  SymmetricRegion out{};
  FERRY_CHECK_CUDA(cudaMemcpy(out.view.ptr, pointer_scratch_, lsa_size_ * sizeof(char*), cudaMemcpyDeviceToHost));
  out.local = region.ptr;
  out.view.bytes = region.bytes;
  out.view.lsa_first = lsa_first_;
  out.view.lsa_size = lsa_size_;
  out.ranks.resize(static_cast<std::size_t>(world));  // null outside the team: only the network reaches those
  for (int r = 0; r < world; ++r) out.ranks[static_cast<std::size_t>(r)] = out.view.peer(r);
  regions_.back().view = out;
  return out;
}

void CudaCommunicator::check_errors(cudaStream_t stream) {
  ensure_usable();
  if (stream != nullptr) synchronize_stream(stream);  // a late peer: interruptible (include/ferry/interrupt.hpp)

  // 1. a recorded failure: status reaches its final value only after the kernel filled the fields (and fenced at
  //    system scope). A timeout (a peer may be gone) and calls out of step (nothing later can be paired) both fail
  //    the communicator.
  if (uint32_t const status = __atomic_load_n(&error_host_->status, __ATOMIC_ACQUIRE);
      status == kErrorTimeout || status == kErrorOutOfStep) {
    DeviceErrorBlock block;
    std::memcpy(&block, const_cast<DeviceErrorBlock const*>(error_host_), sizeof(block));
    failure_ = format_error(status == kErrorTimeout ? "timeout" : "ferry", __FILE__, __LINE__,
                            concat(describe_device_error(block, timeout_s_, topology_),
                                   "; this communicator is now unusable: destroy it and create a new one"));
    failed_ = true;
    if (status == kErrorTimeout) throw TimeoutError(failure_);
    throw Error(failure_);
  }

  // 2. a call a peer refused on input (its abort flag in the exchange): refused here too
  if (__atomic_load_n(&error_host_->refusals, __ATOMIC_ACQUIRE) != 0) {
    int32_t const peer = __atomic_load_n(&error_host_->refusing_rank, __ATOMIC_ACQUIRE);
    auto const phase = static_cast<WaitPhase>(__atomic_load_n(&error_host_->refused_phase, __ATOMIC_ACQUIRE));
    __atomic_store_n(&error_host_->refusals, 0u, __ATOMIC_RELEASE);
    FERRY_THROW(InputError, "input", describe_refusal(peer, phase, refusal_of(peer)));
  }

  // 3. ids the device dropped: an input problem of the last calls, the communicator stays usable
  DeviceErrorBlock block{};
  block.input_errors = __atomic_load_n(&error_host_->input_errors, __ATOMIC_ACQUIRE);
  block.overflow_rows = __atomic_load_n(&error_host_->overflow_rows, __ATOMIC_ACQUIRE);
  if (block.input_errors != 0 || block.overflow_rows != 0) {
    block.first_bad_value = __atomic_load_n(&error_host_->first_bad_value, __ATOMIC_ACQUIRE);
    block.overflow_rank = __atomic_load_n(&error_host_->overflow_rank, __ATOMIC_ACQUIRE);
    __atomic_store_n(&error_host_->input_errors, 0u, __ATOMIC_RELEASE);
    __atomic_store_n(&error_host_->overflow_rows, 0u, __ATOMIC_RELEASE);
    __atomic_store_n(&error_host_->overflow_rank, 0u, __ATOMIC_RELEASE);
    __atomic_store_n(&error_host_->first_bad_value, 0, __ATOMIC_RELEASE);
    FERRY_THROW(InputError, "input", describe_drops(block, bootstrap_->rank()));
  }
}

void CudaCommunicator::teardown() noexcept {
  int const rank = bootstrap_ ? bootstrap_->rank() : -1;
  // A peer may be gone after a failure (or a failed start): then only local, non-collective calls are safe.
  bool abort = failed_ || !initialized_;
  if (device_ >= 0) cudaSetDevice(device_);
  if (device_ >= 0) {
    cudaError_t const error = cudaDeviceSynchronize();
    if (error != cudaSuccess) {
      log_teardown(rank, "cudaDeviceSynchronize", cudaGetErrorString(error));
      abort = true;
    }
  }
  // 1. every rank is done with every peer's memory before any rank unmaps or frees its own
  if (!abort && bootstrap_) {
    try {
      bootstrap_->barrier();
    } catch (std::exception const& error) {
      log_teardown(rank, "the closing bootstrap barrier", error.what());
      abort = true;
    }
  }
  if (comm_ != nullptr && !abort) {
    // 2. windows (collective, reverse order), their memory, the device communicator, the communicator
    for (auto it = regions_.rbegin(); it != regions_.rend(); ++it) {
      ncclResult_t const result = ncclCommWindowDeregister(comm_, it->window);
      if (result != ncclSuccess) log_teardown(rank, "ncclCommWindowDeregister", ncclGetErrorString(result));
    }
    for (auto it = regions_.rbegin(); it != regions_.rend(); ++it) {
      ncclResult_t const result = ncclMemFree(it->ptr);
      if (result != ncclSuccess) log_teardown(rank, "ncclMemFree", ncclGetErrorString(result));
    }
    if (dev_comm_created_) {
      ncclResult_t const result = ncclDevCommDestroy(comm_, &dev_comm_);
      if (result != ncclSuccess) log_teardown(rank, "ncclDevCommDestroy", ncclGetErrorString(result));
    }
    ncclResult_t const result = ncclCommDestroy(comm_);
    if (result != ncclSuccess) log_teardown(rank, "ncclCommDestroy", ncclGetErrorString(result));
  } else if (comm_ != nullptr) {
    // 2'. a peer may be gone: abort (local; releases the windows and the device communicator), then the memory
    ncclResult_t const result = ncclCommAbort(comm_);
    if (result != ncclSuccess) log_teardown(rank, "ncclCommAbort", ncclGetErrorString(result));
    for (auto it = regions_.rbegin(); it != regions_.rend(); ++it) {
      ncclResult_t const freed = ncclMemFree(it->ptr);
      if (freed != ncclSuccess) log_teardown(rank, "ncclMemFree", ncclGetErrorString(freed));
    }
  }
  regions_.clear();
  comm_ = nullptr;
  // 3. the communicator's own small allocations
  if (pointer_scratch_) cudaFree(pointer_scratch_);
  if (barrier_epoch_) cudaFree(barrier_epoch_);
  if (error_host_) cudaFreeHost(error_host_);
  pointer_scratch_ = nullptr;
  barrier_epoch_ = nullptr;
  error_host_ = nullptr;
}

}  // namespace

std::unique_ptr<Communicator> make_cuda_communicator(std::unique_ptr<Bootstrap> bootstrap,
                                                     CommunicatorOptions const& options) {
  // init() may throw half-way: the destructor then releases what it got, with local calls only.
  auto comm = std::make_unique<CudaCommunicator>(std::move(bootstrap));
  comm->init(options);
  return comm;
}

transport::Kind network_transport(Communicator const& comm) {
  auto const* cuda = dynamic_cast<CudaCommunicator const*>(&comm);
  return cuda != nullptr && cuda->has_gin() ? transport::Kind::gin : transport::Kind::emulated;
}

transport::Gin gin_transport(Communicator& comm, SymmetricRegion const& region, std::size_t signals_off,
                             uint32_t num_signals) {
  auto* const cuda = dynamic_cast<CudaCommunicator*>(&comm);
  FERRY_CHECK_CONFIG(cuda != nullptr, "gin_transport: GIN is a cuda communicator's; this one is ",
                     backend_name(comm.backend()));
  return cuda->gin_transport(region, signals_off, num_signals);
}

int cuda_visible_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear it: no driver or no device is an answer here, not an error
    return 0;
  }
  return count;
}

}  // namespace ferry::detail
