// The cpu backend of Communicator: the symmetric heap is POSIX shared memory mapped by every rank process (or
// thread), the error block is ordinary memory, and the barrier is a bounded wait on shared-memory signal words. It
// is the reference the cuda backend is compared with, so it communicates through its own memory, not through the
// bootstrap (which only sets the segments up).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_impl.hpp"
#include "core/interrupt.hpp"
#include "core/log.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {
namespace {

// NOTE: segments are sized in whole pages so every rank's copy starts page-aligned (16-byte vectors, atomics).
constexpr std::size_t kPageBytes = 4096;
constexpr std::size_t kNameBytes = 128;

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
              "signal words are shared between processes: their atomics must be lock-free");

std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

std::string errno_text(int error) {
  return concat(std::strerror(error), " (errno ", error, ")");
}

// What rank 0 tells the others after creating a segment.
struct CreatedSegment {
  int32_t error = 0;  // errno of the failed step, 0 on success
  int32_t step = 0;   // 0 shm_open, 1 ftruncate, 2 posix_fallocate
  char name[kNameBytes] = {};
};

char const* creation_step(int32_t step) {
  switch (step) {
    case 0:
      return "shm_open";
    case 1:
      return "ftruncate";
    default:
      return "posix_fallocate";
  }
}

// Removes the segment's name when it goes out of scope on rank 0: after every rank has mapped it, and on every
// error path, so no segment outlives the job even if it crashes.
class NameGuard {
 public:
  explicit NameGuard(std::string name) : name_(std::move(name)) {}
  ~NameGuard() {
    if (!name_.empty() && shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
      FERRY_LOG_WARN("cpu communicator: shm_unlink(", name_, ") failed: ", errno_text(errno));
  }
  NameGuard(NameGuard const&) = delete;
  NameGuard& operator=(NameGuard const&) = delete;

 private:
  std::string name_;
};

// Segments whose creator died between shm_open and the unlink that follows every rank's mapping (SIGKILL or SIGTERM
// of rank 0 while buffers are being created) keep their name, and their memory, in /dev/shm. Each name carries the
// pid of the rank 0 that made it ("ferry-<pid>-<salt>-<n>"): a name whose process is gone and that is older than any
// creation window is removed, with a log line. NOTE: the age rule leaves a live job's segment alone even where pids
// of other pid namespaces look gone from here (its name lives for milliseconds only).
constexpr int kStaleSegmentAgeS = 10;

void sweep_stale_segments() noexcept {
  DIR* const dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  time_t const now = time(nullptr);
  while (dirent const* entry = readdir(dir)) {
    std::string const name = entry->d_name;
    long pid = 0;
    char salt[32] = {};
    unsigned long long index = 0;
    if (name.rfind("ferry-", 0) != 0 ||
        std::sscanf(name.c_str(), "ferry-%ld-%31[0-9a-f]-%llu", &pid, salt, &index) != 3)
      continue;
    if (pid <= 0 || kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::string const path = "/dev/shm/" + name;
    struct stat info {};
    if (stat(path.c_str(), &info) != 0 || now - info.st_mtime < kStaleSegmentAgeS) continue;
    if (shm_unlink(("/" + name).c_str()) == 0)
      FERRY_LOG_WARN("cpu communicator: removed stale shared memory segment /", name, " (", info.st_size,
                     " bytes) left by process ", pid, ", which is gone (killed while creating buffers)");
  }
  closedir(dir);
}

// The fewest nodes of equal size, each within one load/store team, that a world splits into (a suggestion).
Topology smallest_nodes(int world) {
  for (int nodes = 1; nodes <= world; ++nodes)
    if (world % nodes == 0 && world / nodes <= kMaxLsaTeam) return {nodes, world / nodes};
  return {world, 1};
}

struct Mapping {
  void* base = nullptr;
  std::size_t bytes = 0;
};

// The segments this process maps, by name. Ranks that are threads of one process (LocalBootstrap) share one mapping
// of each segment, so a byte has one address in the process whichever rank touches it: ThreadSanitizer, which keys on
// addresses, relates the ranks' accesses (with a mapping per rank it could not see a race between ranks), and a world
// of threads maps each segment once. The last rank that lets go unmaps it.
class ProcessMappings {
 public:
  // The segment `name` of `bytes` in this process: the mapping a rank of this process made already, or a new one
  // (of the open descriptor `fd`, or of the name opened here when fd < 0). MAP_FAILED with errno set on failure.
  static void* attach(std::string const& name, int fd, std::size_t bytes) {
    std::lock_guard<std::mutex> const lock(mutex());
    auto& all = entries();
    if (auto const it = all.find(name); it != all.end()) {
      FERRY_CHECK(it->second.bytes == bytes, "segment ", name, " is mapped with ", it->second.bytes,
                  " bytes in this process, asked for ", bytes);
      ++it->second.refs;
      return it->second.base;
    }
    int const own = fd >= 0 ? -1 : shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0 && own < 0) return MAP_FAILED;
    void* const base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd >= 0 ? fd : own, 0);
    int const error = errno;
    if (own >= 0) close(own);
    errno = error;
    if (base != MAP_FAILED) all[name] = Entry{base, bytes, 1};
    return base;
  }
  // One rank lets go of the mapping at `base`; the last one unmaps it. False when munmap failed (errno set).
  static bool detach(void* base, std::size_t bytes) noexcept {
    std::lock_guard<std::mutex> const lock(mutex());
    auto& all = entries();
    auto const it =
        std::find_if(all.begin(), all.end(), [base](auto const& entry) { return entry.second.base == base; });
    if (it != all.end()) {
      if (--it->second.refs > 0) return true;
      all.erase(it);
    }
    return munmap(base, bytes) == 0;
  }

 private:
  struct Entry {
    void* base;
    std::size_t bytes;
    int refs;
  };
  // Function-local statics: a communicator made during static initialization finds them constructed.
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<std::string, Entry>& entries() {
    static auto* const e = new std::map<std::string, Entry>();  // never destroyed: used by destructors at exit
    return *e;
  }
};

class CpuCommunicator final : public Communicator {
 public:
  CpuCommunicator(std::unique_ptr<Bootstrap> bootstrap, CommunicatorOptions const& options);
  ~CpuCommunicator() override;
  CpuCommunicator(CpuCommunicator const&) = delete;
  CpuCommunicator& operator=(CpuCommunicator const&) = delete;

  Backend backend() const override { return Backend::cpu; }
  Bootstrap& bootstrap() const override { return *bootstrap_; }
  int device() const override { return -1; }
  Topology const& topology() const override { return topology_; }
  // Every rank maps every segment, but a peer on another (emulated) node is treated as the network would be.
  bool load_store_reachable(int peer) const override { return topology_.same_node(rank_, peer); }

  SymmetricRegion alloc_symmetric(std::size_t bytes) override;
  void release_symmetric(SymmetricRegion const& region) noexcept override;
  void post_refusal(std::string const& reason) override;
  std::string refusal_of(int rank) override;
  DeviceView const& device_view() const override { return view_; }
  void check_errors(cudaStream_t stream) override;
  bool failed() const override { return failed_; }
  void ensure_usable() const override {
    if (failed_) FERRY_THROW(Error, "ferry", "communicator failed earlier: ", failure_, "; create a new communicator");
    bootstrap_->check_alive();  // a job stopped by its bootstrap (two jobs on one port) stops its calls too
  }
  void barrier(cudaStream_t stream) override;

 private:
  void record_timeout(WaitPhase phase, std::vector<int> const& missing, uint64_t expected, uint64_t observed);
  void release_mappings() noexcept;

  std::unique_ptr<Bootstrap> bootstrap_;
  int rank_ = 0;
  int world_ = 1;
  double timeout_s_ = 0.0;
  std::unique_ptr<DeviceErrorBlock> error_ = std::make_unique<DeviceErrorBlock>();
  uint64_t barrier_epoch_ = 0;
  DeviceView view_{};
  std::string segment_prefix_;  // "/ferry-<pid of rank 0>-<random>", the same on every rank
  uint64_t num_segments_ = 0;
  std::vector<Mapping> mappings_;
  SymmetricRegion signals_;   // view_.signals, every rank's copy (the barrier reaches every rank)
  SymmetricRegion refusals_;  // [world] kRefusalBytes: each rank's reason for its last refused call
  Topology topology_;
  bool failed_ = false;
  std::string failure_;
};

CpuCommunicator::CpuCommunicator(std::unique_ptr<Bootstrap> bootstrap, CommunicatorOptions const& options)
    : bootstrap_(std::move(bootstrap)) {
  rank_ = bootstrap_->rank();
  world_ = bootstrap_->world();
  FERRY_CHECK_CONFIG(world_ >= 1 && world_ <= kMaxWorld, "world=", world_, " is outside [1, ", kMaxWorld,
                     "] (kMaxWorld), the ranks of one world");
  // NOTE: the symmetric heap is shared memory of one host; ranks on other hosts could not map it.
  FERRY_CHECK_CONFIG(bootstrap_->local_world() == world_, "backend cpu needs every rank on one host: world=", world_,
                     " but local_world=", bootstrap_->local_world(), "; use backend cuda across hosts");
  timeout_s_ = env_double("FERRY_TIMEOUT_S");  // its rule (positive) is the env table's
  topology_ = agree_on_topology(*bootstrap_, options.topology, [&](Topology const& topology) {
    // NOTE: a node is this rank's load/store team, and SymmetricView holds a pointer per rank of the team.
    FERRY_CHECK_CONFIG(topology.local <= kMaxLsaTeam, "topology ", topology_name(topology), ": a node of ",
                       topology.local, " ranks is more than the ", kMaxLsaTeam,
                       " ranks of one load/store team (kMaxLsaTeam); emulate smaller nodes, e.g. FERRY_TOPOLOGY=",
                       topology_name(smallest_nodes(world_)));
  });
  // 1. a name prefix no other job uses: rank 0's pid plus random bits, the same on every rank
  char prefix[kNameBytes] = {};
  if (rank_ == 0) {
    sweep_stale_segments();
    std::random_device device;
    uint64_t const salt = (static_cast<uint64_t>(device()) << 32) ^ device();
    std::snprintf(prefix, sizeof(prefix), "/ferry-%ld-%016llx", static_cast<long>(getpid()),
                  static_cast<unsigned long long>(salt));
  }
  bootstrap_->broadcast(prefix, sizeof(prefix), 0);
  segment_prefix_ = prefix;

  // 2. the view: signals in symmetric memory, the error block and the barrier epoch in this rank's memory
  view_.rank = rank_;
  view_.world = world_;
  view_.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
  view_.error = error_.get();
  view_.barrier_epoch = &barrier_epoch_;
  signals_ = alloc_symmetric(sizeof(uint64_t) * kSignalSlots);
  view_.signals = signals_.view;
  refusals_ = alloc_symmetric(kRefusalBytes * static_cast<std::size_t>(world_));
}

CpuCommunicator::~CpuCommunicator() {
  release_mappings();
}

void CpuCommunicator::release_symmetric(SymmetricRegion const& region) noexcept {
  // Local: the segment holds every rank's copy and lives until the last rank unmaps it, so a peer still using its
  // mapping is unaffected; this rank's share of the memory goes now.
  char* const base = region.ranks.empty() ? nullptr : region.ranks.front();  // the segment starts with rank 0's
  auto const it =
      std::find_if(mappings_.begin(), mappings_.end(), [base](Mapping const& mapping) { return mapping.base == base; });
  if (base == nullptr || it == mappings_.end()) return;  // not this communicator's, or released already
  if (!ProcessMappings::detach(it->base, it->bytes))
    FERRY_LOG_WARN("cpu communicator (rank ", rank_, "): munmap of ", it->bytes, " bytes failed: ", errno_text(errno));
  mappings_.erase(it);
}

void CpuCommunicator::post_refusal(std::string const& reason) {
  // Written before this rank joins the refused call's exchange, whose barrier (release / acquire) publishes it.
  char* const slot = refusals_.of(rank_);
  std::size_t const n = std::min(reason.size(), kRefusalBytes - 1);
  std::memcpy(slot, reason.data(), n);
  slot[n] = '\0';
}

std::string CpuCommunicator::refusal_of(int rank) {
  FERRY_CHECK(rank >= 0 && rank < world_, "refusal_of(", rank, "): no such rank in a world of ", world_);
  char const* const slot = refusals_.of(rank);
  return std::string(slot, strnlen(slot, kRefusalBytes));
}

void CpuCommunicator::release_mappings() noexcept {
  // Local only: the memory lives on while a peer still maps it, so tearing down never needs the others.
  for (Mapping const& mapping : mappings_)
    if (!ProcessMappings::detach(mapping.base, mapping.bytes))
      FERRY_LOG_WARN("cpu communicator (rank ", rank_, "): munmap of ", mapping.bytes,
                     " bytes failed: ", errno_text(errno));
  mappings_.clear();
}

SymmetricRegion CpuCommunicator::alloc_symmetric(std::size_t bytes) {
  ensure_usable();
  FERRY_CHECK_CONFIG(bytes > 0, "alloc_symmetric(0): ask for at least one byte");
  std::size_t const rounded = round_up(bytes, kPageBytes);

  // 1. every rank asks for the same size (collective calls in the same order)
  std::vector<uint64_t> sizes(static_cast<std::size_t>(world_));
  uint64_t const mine = rounded;
  bootstrap_->allgather(&mine, sizes.data(), sizeof(mine));
  for (int r = 0; r < world_; ++r)
    FERRY_CHECK_CONFIG(sizes[static_cast<std::size_t>(r)] == rounded, "alloc_symmetric: rank ", rank_, " asked for ",
                       rounded, " bytes but rank ", r, " for ", sizes[static_cast<std::size_t>(r)],
                       " (rounded to pages); every rank must allocate the same sizes in the same order");
  FERRY_CHECK_CONFIG(rounded <= SIZE_MAX / static_cast<std::size_t>(world_), "alloc_symmetric: ", rounded,
                     " bytes on each of ", world_, " ranks overflows the address space");
  std::size_t const total = rounded * static_cast<std::size_t>(world_);

  // 2. rank 0 creates one segment holding every rank's copy. NOTE: posix_fallocate reserves the pages now, so a full
  //    /dev/shm is an error here instead of a SIGBUS at the first touch.
  CreatedSegment created;
  std::string const name = concat(segment_prefix_, "-", num_segments_++);
  std::snprintf(created.name, sizeof(created.name), "%s", name.c_str());
  int fd = -1;
  if (rank_ == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      created.error = errno;
      created.step = 0;
    } else if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
      created.error = errno;
      created.step = 1;
    } else if (int const rc = posix_fallocate(fd, 0, static_cast<off_t>(total)); rc != 0) {
      created.error = rc;
      created.step = 2;
    }
  }
  // Rank 0 removes the name however this ends (after the others mapped it, or on any failure).
  NameGuard const guard(rank_ == 0 && !(created.error != 0 && created.step == 0) ? name : std::string());
  bootstrap_->broadcast(&created, sizeof(created), 0);
  if (created.error != 0) {
    if (fd >= 0) close(fd);
    FERRY_THROW(Error, "ferry", "cpu communicator: ", creation_step(created.step), " of shared memory segment ",
                created.name, " (", total, " bytes = ", world_, " ranks x ", rounded,
                " bytes) failed on rank 0: ", errno_text(created.error),
                "; free space in /dev/shm (or enlarge it, e.g. docker --shm-size) or lower max_tokens_per_rank / "
                "max_recv_tokens / hidden");
  }

  // 3. every rank maps the whole segment (ranks that are threads of one process: one mapping, ProcessMappings)
  int32_t map_error = 0;
  void* const base = ProcessMappings::attach(created.name, fd, total);
  if (base == MAP_FAILED) map_error = errno;
  if (fd >= 0) close(fd);

  // 4. all ranks report; then rank 0's guard removes the name. From here on the memory exists only as long as some
  //    rank maps it: no segment outlives a crash.
  std::vector<int32_t> map_errors(static_cast<std::size_t>(world_));
  try {
    bootstrap_->allgather(&map_error, map_errors.data(), sizeof(map_error));
  } catch (...) {
    if (base != MAP_FAILED) ProcessMappings::detach(base, total);
    throw;
  }
  for (int r = 0; r < world_; ++r) {
    if (map_errors[static_cast<std::size_t>(r)] == 0) continue;
    if (base != MAP_FAILED) ProcessMappings::detach(base, total);
    FERRY_THROW(Error, "ferry", "cpu communicator: rank ", r, " could not map shared memory segment ", created.name,
                " (", total, " bytes): ", errno_text(map_errors[static_cast<std::size_t>(r)]),
                "; backend cpu needs every rank on one host with room for the segment in its address space");
  }
  mappings_.push_back(Mapping{base, total});

  // 5. every rank's copy; the kernels' view holds this rank's node, its load/store team
  SymmetricRegion region;
  region.ranks.resize(static_cast<std::size_t>(world_));
  for (int r = 0; r < world_; ++r)
    region.ranks[static_cast<std::size_t>(r)] = static_cast<char*>(base) + static_cast<std::size_t>(r) * rounded;
  region.local = region.of(rank_);
  region.view.bytes = rounded;
  region.view.lsa_first = topology_.node_of(rank_) * topology_.local;
  region.view.lsa_size = topology_.local;
  for (int slot = 0; slot < topology_.local; ++slot) region.view.ptr[slot] = region.of(region.view.lsa_first + slot);
  return region;
}

void CpuCommunicator::record_timeout(WaitPhase phase, std::vector<int> const& missing, uint64_t expected,
                                     uint64_t observed) {
  // First writer wins, as on the device: 0 -> 1 (filling) -> 2 (recorded).
  std::atomic_ref<uint32_t> status(error_->status);
  uint32_t idle = 0;
  if (status.compare_exchange_strong(idle, 1u, std::memory_order_acq_rel)) {
    error_->rank = rank_;
    error_->peer = missing.size() == 1 ? missing.front() : -1;
    error_->phase = static_cast<int32_t>(phase);
    error_->expected = expected;
    error_->observed = observed;
    status.store(kErrorTimeout, std::memory_order_release);
  }
  std::string const where = describe_absent(missing, topology_);
  std::string ranks;
  for (int r : missing) ranks += concat(ranks.empty() ? "" : ", ", r);
  failure_ = format_error(
      "timeout", __FILE__, __LINE__,
      concat("rank ", rank_, " timed out after ", timeout_s_, " s in phase '", wait_phase_name(phase), "' waiting for ",
             where, " (expected signal >= ", expected, ", observed ", observed, "); rank(s) ", ranks,
             " did not arrive: stuck, crashed, or skipped a collective call; this communicator "
             "is now unusable: destroy it and create a new one"));
  failed_ = true;
  throw TimeoutError(failure_);
}

void CpuCommunicator::barrier(cudaStream_t stream) {
  FERRY_CHECK_INPUT(stream == nullptr, "the cpu backend runs on the host: stream must be null, got ",
                    static_cast<void*>(stream));
  ensure_usable();
  uint64_t const epoch = ++barrier_epoch_;
  std::size_t const my_slot = static_cast<std::size_t>(rank_) * sizeof(uint64_t);

  // 1. announce the epoch in slot `rank` of every rank's signal area (release: everything this rank wrote before
  //    the barrier is visible to a rank that sees the epoch)
  for (int p = 0; p < world_; ++p)
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(signals_.of(p) + my_slot))
        .store(epoch, std::memory_order_release);

  // 2. wait until every rank announced it here (acquire: their writes before the barrier are visible after it).
  //    Bounded by FERRY_TIMEOUT_S; spins briefly, then yields, then sleeps, so oversubscribed hosts make progress.
  auto* const slots = reinterpret_cast<uint64_t*>(signals_.local);
  auto const start = std::chrono::steady_clock::now();
  auto const deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(timeout_s_));
  int arrived_upto = 0;  // ranks below have arrived
  for (uint64_t spin = 0;; ++spin) {
    while (arrived_upto < world_ &&
           std::atomic_ref<uint64_t>(slots[arrived_upto]).load(std::memory_order_acquire) >= epoch)
      ++arrived_upto;
    if (arrived_upto == world_) return;
    if (spin < 64) continue;
    // (asked in the yields too: on a loaded host a thousand yields last seconds)
    if (interrupt_requested()) fail_interrupted(*this, WaitPhase::barrier);
    if (spin < 1024) {
      std::this_thread::yield();
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::vector<int> missing;
      uint64_t observed = epoch;
      for (int p = 0; p < world_; ++p) {
        uint64_t const seen = std::atomic_ref<uint64_t>(slots[p]).load(std::memory_order_acquire);
        if (seen < epoch) {
          missing.push_back(p);
          observed = std::min(observed, seen);
        }
      }
      if (missing.empty()) return;  // arrived at the last moment
      record_timeout(WaitPhase::barrier, missing, epoch, observed);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void CpuCommunicator::check_errors(cudaStream_t stream) {
  FERRY_CHECK_INPUT(stream == nullptr, "the cpu backend runs on the host: stream must be null, got ",
                    static_cast<void*>(stream));
  ensure_usable();

  // 1. a recorded timeout (the cpu barrier throws at once; this catches one recorded by another host-side wait), or
  //    an interrupted wait: this rank left an exchange midway, so nothing later can be paired
  uint32_t const status = std::atomic_ref<uint32_t>(error_->status).load(std::memory_order_acquire);
  if (status == kErrorInterrupted) {
    failure_ = format_error(
        "interrupted", __FILE__, __LINE__,
        concat("rank ", rank_, "'s wait in phase '", wait_phase_name(static_cast<WaitPhase>(error_->phase)),
               "' was interrupted (a signal: KeyboardInterrupt in Python); it left the exchange "
               "midway, so this communicator is now unusable: destroy it and create a new one"));
    failed_ = true;
    throw Interrupted(failure_);
  }
  if (status == kErrorTimeout) {
    failure_ = format_error("timeout", __FILE__, __LINE__,
                            concat(describe_device_error(*error_, timeout_s_, topology_),
                                   "; this communicator is now unusable: destroy it and create a new one"));
    failed_ = true;
    throw TimeoutError(failure_);
  }

  // 2. a call a peer refused on input (its abort flag in the exchange): refused here too
  if (error_->refusals != 0) {
    int32_t const peer = error_->refusing_rank;
    error_->refusals = 0;
    FERRY_THROW(InputError, "input",
                describe_refusal(peer, static_cast<WaitPhase>(error_->refused_phase), refusal_of(peer)));
  }

  // 3. rows or ids that were dropped: an input problem of the last calls; nothing was corrupted, so the communicator
  //    stays usable and the counters start again from 0
  std::string const message = describe_drops(*error_, rank_);
  if (message.empty()) return;
  error_->input_errors = 0;
  error_->overflow_rows = 0;
  error_->overflow_rank = 0;
  error_->first_bad_value = 0;
  FERRY_THROW(InputError, "input", message);
}

}  // namespace

std::unique_ptr<Communicator> make_cpu_communicator(std::unique_ptr<Bootstrap> bootstrap,
                                                    CommunicatorOptions const& options) {
  return std::make_unique<CpuCommunicator>(std::move(bootstrap), options);
}

}  // namespace ferry::detail
