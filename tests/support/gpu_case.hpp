// What the multi-GPU tests share: the skip-or-launch step of a TEST, the key=value arguments a rank case receives,
// and (cuda builds) a checked CUDA call, the communicator a rank case starts with, device buffers and
// device-to-host copies.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/rank_case.hpp"
#include "workloads/routing.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry::test {

// A seed that differs between runs (printed by the callers), small enough to pass as text.
inline uint64_t fresh_seed() {
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) % 1000000007ull;
}

// The world the EP tests run at: FERRY_TEST_WORLD when set (1 to 8, one process per GPU), else 2. Their matrices
// are written for any world: per-rank lists given for 2 ranks repeat over the ranks (per_rank), expectations come
// from the reference at the communicator's world. World 1 (every expert local, no peer) lets a one-GPU machine check
// the kernels' local work exactly; the cases that need a peer run at peer_case_world(). NOTE: worlds 1 and 2 have
// run so far (no 4- or 8-GPU machine lent).
inline int gpu_test_world() {
  char const* text = std::getenv("FERRY_TEST_WORLD");
  if (!text || !*text) return 2;
  char* end = nullptr;
  long const world = std::strtol(text, &end, 10);
  if (*end != '\0' || world < 1 || world > 8)
    throw std::invalid_argument(std::string("FERRY_TEST_WORLD=") + text + ": expected a world size from 1 to 8");
  return static_cast<int>(world);
}

// The world of a case that needs a rank that does not arrive (timeouts): gpu_test_world(), at least 2.
inline int peer_case_world() {
  int const world = gpu_test_world();
  return world < 2 ? 2 : world;
}

// values[r] for each of `world` ranks, the list repeated when it is shorter (the matrices' lists are for 2 ranks).
inline std::vector<int> per_rank(std::vector<int> const& values, int world) {
  std::vector<int> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) out[r] = values.empty() ? 0 : values[r % values.size()];
  return out;
}

// Runs rank case `name` on `world` processes (one per GPU); skips the calling test below `world` GPUs.
inline void run_gpu_case(int world, char const* name, std::vector<std::string> args,
                         std::vector<std::pair<std::string, std::string>> env = {},
                         std::chrono::seconds timeout = std::chrono::seconds(300)) {
  int const gpus = ferry::cuda_device_count();
  if (gpus < world) GTEST_SKIP() << needs_gpus_message(world, gpus);
  RankCaseOptions options;
  options.args = std::move(args);
  options.env = std::move(env);
  options.timeout = timeout;
  LaunchResult const result = run_rank_case(name, world, options);
  EXPECT_TRUE(result.ok()) << result.describe();
}

// The key=value words of a rank case's command line (a word without '=' has an empty value).
class CaseArgs {
 public:
  explicit CaseArgs(std::vector<std::string> const& words) {
    for (auto const& word : words) {
      auto const eq = word.find('=');
      values_[word.substr(0, eq)] = eq == std::string::npos ? "" : word.substr(eq + 1);
    }
  }
  std::string text(char const* key, std::string fallback) const {
    auto const found = values_.find(key);
    return found == values_.end() ? fallback : found->second;
  }
  int integer(char const* key, int fallback) const { return has(key) ? std::stoi(values_.at(key)) : fallback; }
  double number(char const* key, double fallback) const { return has(key) ? std::stod(values_.at(key)) : fallback; }
  uint64_t u64(char const* key, uint64_t fallback) const { return has(key) ? std::stoull(values_.at(key)) : fallback; }
  bool flag(char const* key, bool fallback) const { return has(key) ? values_.at(key) == "1" : fallback; }
  // "100,37" -> {100, 37}
  std::vector<int> integers(char const* key, std::vector<int> fallback) const {
    if (!has(key)) return fallback;
    std::vector<int> out;
    std::string const& value = values_.at(key);
    std::size_t pos = 0;
    while (pos <= value.size()) {
      auto const comma = value.find(',', pos);
      out.push_back(std::stoi(value.substr(pos, comma - pos)));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
    return out;
  }

 private:
  bool has(char const* key) const { return values_.count(key) > 0; }
  std::map<std::string, std::string> values_;
};

// What every EP rank case reads from its key=value words (each case's Spec adds its own keys): the routing, the
// tokens per rank (written for 2 ranks, repeated over the ranks by per_rank), the layer's shape, the iterations,
// graph mode and the seed.
struct CaseShape {
  std::string routing = "random";   // routing=random|ring|grouped|hot
  std::vector<int> tokens{64, 64};  // tokens=100,37
  int hidden = 2048;                // hidden=
  int topk = 8;                     // topk=
  int experts = 64;                 // experts=
  double mask_rate = 0.0;           // mask= (probability that a routed entry is -1)
  int iters = 1;                    // iters= (fresh inputs each)
  bool graph = false;               // graph=1: captured calls, replayed
  int shared = 0;                   // shared=n: n trailing topk columns pinned to an expert of the own rank
  uint64_t seed = 1;                // seed= (printed by the test that starts the case)

  void read(CaseArgs const& args) {
    routing = args.text("routing", routing);
    tokens = args.integers("tokens", tokens);
    hidden = args.integer("hidden", hidden);
    topk = args.integer("topk", topk);
    experts = args.integer("experts", experts);
    mask_rate = args.number("mask", mask_rate);
    iters = args.integer("iters", iters);
    graph = args.flag("graph", graph);
    shared = args.integer("shared", shared);
    seed = args.u64("seed", seed);
  }
  // The most tokens any rank passes (at least 1: the buffers' max_tokens_per_rank).
  int most_tokens() const { return std::max(1, *std::max_element(tokens.begin(), tokens.end())); }
  // The config of this shape; mode, formats and capacities are the case's.
  EpConfig config() const {
    EpConfig config;
    config.hidden = hidden;
    config.topk = topk;
    config.num_experts = experts;
    config.max_tokens_per_rank = most_tokens();
    return config;
  }
  // The routing of iteration `iter`: fresh every iteration, reproducible from the seed.
  RoutingOptions routing_options(int iter) const {
    RoutingOptions options;
    options.kind = parse_routing(routing);
    options.mask_rate = mask_rate;
    options.shared_experts = shared;
    options.seed = seed + static_cast<uint64_t>(iter) * 7919u;
    return options;
  }
};

#if FERRY_HAVE_CUDA

#define CK(expr)                                                                                   \
  do {                                                                                             \
    cudaError_t const e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) FERRY_THROW(Error, "test", #expr, " failed: ", cudaGetErrorString(e_)); \
  } while (0)

// The cuda communicator of a rank case, from the environment ferry's launcher sets.
inline std::shared_ptr<Communicator> make_cuda_comm() {
  return connect_rank(Backend::cuda);
}

// A device allocation of at least 16 bytes at a fixed address (a captured graph reads whatever is copied into it
// before a replay). Movable, not copyable.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DeviceBuffer(std::size_t n) : bytes(std::max<std::size_t>(n, 16)) { CK(cudaMalloc(&ptr, bytes)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer&& other) noexcept : ptr(std::exchange(other.ptr, nullptr)), bytes(other.bytes) {}
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
};

template <typename T>
std::vector<T> to_host(void const* dev, std::size_t count) {
  std::vector<T> out(count);
  if (count) CK(cudaMemcpy(out.data(), dev, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

#endif

// A rank case's mismatch report: prints what, where, and returns the failing exit code.
inline int fail(char const* what, int rank, int iter, long index) {
  std::fprintf(stderr, "rank %d iter %d: %s mismatch at %ld\n", rank, iter, what, index);
  return 1;
}

// Index of the first element of a and b whose bytes differ, -1 when none.
template <typename T>
long first_diff(T const* a, T const* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, sizeof(T)) != 0) return static_cast<long>(i);
  return -1;
}

}  // namespace ferry::test
