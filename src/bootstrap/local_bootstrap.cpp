// LocalBootstrap: the ranks are threads of one process (tests, single-process tools). The collectives meet in one
// shared state guarded by a mutex; the n-th collective of every rank is matched with the n-th of the others by its
// sequence number, so a rank that calls a different operation, or never arrives, is detected and named.
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "bootstrap/bootstrap_util.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/error.hpp"

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;

// One collective operation in flight, shared by every rank that called it.
struct LocalOp {
  detail::BootstrapOpDesc desc;  // what the first rank to arrive called; the others must match it
  int first_rank = -1;
  std::vector<char> data;  // allgather: world * bytes; broadcast: bytes (filled by the root)
  std::vector<bool> arrived;
  int num_arrived = 0;
  int num_left = 0;  // ranks that copied their result out; the last one erases the op
};

struct LocalState {
  LocalState(int world_, std::chrono::milliseconds timeout_) : world(world_), timeout(timeout_), closed(world_) {}

  int const world;
  std::chrono::milliseconds const timeout;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<uint64_t, LocalOp> ops;  // by sequence number
  std::vector<bool> closed;         // rank r's Bootstrap was destroyed: it will never arrive again
  std::string failure;              // first error; once set every call (in flight or later) throws it
};

class LocalBootstrap final : public Bootstrap {
 public:
  LocalBootstrap(std::shared_ptr<LocalState> state, int rank) : state_(std::move(state)), rank_(rank) {}

  ~LocalBootstrap() override {
    // Tell ranks waiting for this one that it is gone, so they fail at once instead of at the deadline.
    std::lock_guard lock(state_->mutex);
    state_->closed[rank_] = true;
    state_->changed.notify_all();
  }

  int rank() const override { return rank_; }
  int world() const override { return state_->world; }
  int local_rank() const override { return rank_; }
  int local_world() const override { return state_->world; }

  void allgather(void const* send, void* recv, std::size_t bytes) override {
    FERRY_CHECK_INPUT(bytes == 0 || (send && recv), "bootstrap allgather of ", bytes, " bytes needs non-null buffers");
    run({detail::BootstrapOp::kAllgather, bytes, -1}, send, recv);
  }

  void broadcast(void* data, std::size_t bytes, int root) override {
    FERRY_CHECK_INPUT(root >= 0 && root < state_->world, "bootstrap broadcast root=", root, " is outside [0, ",
                      state_->world, ")");
    FERRY_CHECK_INPUT(bytes == 0 || data, "bootstrap broadcast of ", bytes, " bytes needs a non-null buffer");
    run({detail::BootstrapOp::kBroadcast, bytes, root}, data, data);
  }

  void barrier() override { run({detail::BootstrapOp::kBarrier, 0, -1}, nullptr, nullptr); }

 private:
  [[noreturn]] void fail(std::unique_lock<std::mutex>& lock, std::string const& message) {
    // Record the first failure for every rank and wake them; then throw this rank's view of it.
    if (state_->failure.empty()) state_->failure = message;
    state_->changed.notify_all();
    lock.unlock();
    FERRY_THROW(BootstrapError, "bootstrap", message);
  }

  // Ranks that have not arrived at op and never will (their Bootstrap was destroyed), or all missing ones.
  std::vector<int> missing_ranks(LocalOp const& op, bool only_closed) const {
    std::vector<int> missing;
    for (int r = 0; r < state_->world; ++r)
      if (!op.arrived[r] && (!only_closed || state_->closed[r])) missing.push_back(r);
    return missing;
  }

  void run(detail::BootstrapOpDesc const& desc, void const* send, void* recv) {
    uint64_t const seq = next_seq_++;
    int const world = state_->world;
    auto const deadline = Clock::now() + state_->timeout;
    std::unique_lock lock(state_->mutex);
    if (!state_->failure.empty())
      fail(lock, detail::concat("local bootstrap already failed earlier (rank ", rank_, " called ",
                                detail::describe(desc), " as operation #", seq, "): ", state_->failure));

    // 1. join the op with this sequence number (or open it) and check that every rank called the same thing
    LocalOp& op = state_->ops[seq];
    if (op.first_rank < 0) {
      op.desc = desc;
      op.first_rank = rank_;
      op.arrived.assign(world, false);
      if (desc.op == detail::BootstrapOp::kAllgather) op.data.resize(world * desc.bytes);
      if (desc.op == detail::BootstrapOp::kBroadcast) op.data.resize(desc.bytes);
    } else if (!(op.desc == desc)) {
      fail(lock, detail::concat("operation #", seq, ": rank ", rank_, " called ", detail::describe(desc),
                                " while rank ", op.first_rank, " called ", detail::describe(op.desc),
                                "; every rank must make the same bootstrap calls in the same order"));
    }

    // 2. contribute (allgather: own block; broadcast: the root's data)
    if (desc.op == detail::BootstrapOp::kAllgather && desc.bytes > 0)
      std::memcpy(op.data.data() + rank_ * desc.bytes, send, desc.bytes);
    if (desc.op == detail::BootstrapOp::kBroadcast && rank_ == desc.root && desc.bytes > 0)
      std::memcpy(op.data.data(), send, desc.bytes);
    op.arrived[rank_] = true;
    ++op.num_arrived;
    state_->changed.notify_all();

    // 3. wait, bounded, for the others; a rank whose Bootstrap is gone will never come, so do not wait for it
    while (op.num_arrived < world) {
      if (!state_->failure.empty()) fail(lock, state_->failure);
      if (auto const gone = missing_ranks(op, true); !gone.empty())
        fail(lock, detail::concat(detail::describe_ranks(gone), " destroyed its bootstrap without calling ",
                                  detail::describe(desc), " (operation #", seq,
                                  "); every rank must make the same bootstrap calls"));
      if (state_->changed.wait_until(lock, deadline) == std::cv_status::timeout && op.num_arrived < world)
        fail(lock, detail::concat(detail::describe_ranks(missing_ranks(op, false)), " did not arrive at ",
                                  detail::describe(desc), " (operation #", seq, ") within ",
                                  detail::describe_duration(state_->timeout), " (rank ", rank_,
                                  " waited); check that every rank makes the same bootstrap calls and none is stuck"));
    }

    // 4. copy the result out; the last rank to leave frees the op
    if (desc.op == detail::BootstrapOp::kAllgather && desc.bytes > 0)
      std::memcpy(recv, op.data.data(), world * desc.bytes);
    if (desc.op == detail::BootstrapOp::kBroadcast && rank_ != desc.root && desc.bytes > 0)
      std::memcpy(recv, op.data.data(), desc.bytes);
    if (++op.num_left == world) state_->ops.erase(seq);
  }

  std::shared_ptr<LocalState> state_;
  int const rank_;
  uint64_t next_seq_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<Bootstrap>> make_local_bootstraps(int world, std::chrono::milliseconds timeout) {
  FERRY_CHECK_CONFIG(world >= 1, "make_local_bootstraps: world=", world, " must be at least 1");
  FERRY_CHECK_CONFIG(timeout.count() > 0, "make_local_bootstraps: timeout=", timeout.count(),
                     " ms must be positive (every bootstrap wait is bounded)");
  auto state = std::make_shared<LocalState>(world, timeout);
  std::vector<std::unique_ptr<Bootstrap>> bootstraps;
  bootstraps.reserve(world);
  for (int rank = 0; rank < world; ++rank) bootstraps.push_back(std::make_unique<LocalBootstrap>(state, rank));
  return bootstraps;
}

}  // namespace ferry
