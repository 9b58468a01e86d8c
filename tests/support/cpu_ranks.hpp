// Ranks as threads of this process, each with its own cpu communicator over LocalBootstrap: how the host tests run a
// world without processes.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"

namespace ferry::test {

// A dispatch of `in` from host memory (the cpu backend reads its arrays in place).
inline DispatchArgs host_dispatch_args(ref::RankInput const& in, bool expand = false) {
  DispatchArgs args;
  args.x = in.x.data();
  args.num_tokens = in.num_tokens;
  args.topk_idx = in.topk_idx.data();
  args.topk_weights = in.topk_weights.data();
  args.expand = expand;
  return args;
}

// A small low-latency config with rank masking on (hidden 64, 4 experts, topk 2, 4 tokens per rank): the host tests of
// waits, at a world of 1, 2 or 4.
inline EpConfig small_masked_ll_config() {
  EpConfig config;
  config.mode = Mode::low_latency;
  config.hidden = 64;
  config.num_experts = 4;
  config.topk = 2;
  config.max_tokens_per_rank = 4;
  config.rank_masking = true;
  return config;
}

// Runs fn(rank, communicator) on `world` threads, each communicator made with `options` (its backend must be cpu).
// Returns each rank's failure: what it threw ("" when it returned).
inline std::vector<std::string> run_cpu_ranks(int world,
                                              std::function<void(int, std::shared_ptr<Communicator> const&)> const& fn,
                                              CommunicatorOptions const& options = {Backend::cpu}) {
  auto bootstraps = make_local_bootstraps(world, std::chrono::seconds(20));
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::shared_ptr<Communicator> const comm =
            Communicator::create(std::move(bootstraps[static_cast<std::size_t>(r)]), options);
        fn(r, comm);
      } catch (std::exception const& error) {
        failures[static_cast<std::size_t>(r)] = error.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return failures;
}

}  // namespace ferry::test
