#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bootstrap/bootstrap_util.hpp"
#include "comm/comm_impl.hpp"
#include "ferry/communicator.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry {

Topology parse_topology(std::string const& text) {
  int nodes = 0, local = 0;
  char tail = 0;
  FERRY_CHECK_CONFIG(std::sscanf(text.c_str(), "%dx%d%c", &nodes, &local, &tail) == 2 && nodes >= 1 && local >= 1,
                     "topology '", text, "' is not of the form NxM (N nodes of M ranks, both at least 1, e.g. 2x8)");
  int64_t const world = int64_t{nodes} * local;
  FERRY_CHECK_CONFIG(world <= kMaxWorld, "topology '", text, "' has ", world, " ranks; a world has at most ", kMaxWorld,
                     " (kMaxWorld, e.g. 32x8)");
  return {nodes, local};
}

std::string topology_name(Topology const& topology) {
  return std::to_string(topology.nodes) + "x" + std::to_string(topology.local);
}

Topology topology_of(int world, int local_world, std::string const& forced) {
  if (!forced.empty()) {
    Topology const topology = parse_topology(forced);
    FERRY_CHECK_CONFIG(topology.world() == world, "FERRY_TOPOLOGY=", forced, " has ", topology.world(),
                       " ranks but the world has ", world, "; give N nodes x M ranks with N x M = ", world);
    return topology;
  }
  FERRY_CHECK_CONFIG(local_world >= 1 && world % local_world == 0, "a world of ", world, " ranks with ", local_world,
                     " on this host does not split into whole nodes; every node must run the same number of ranks "
                     "(LOCAL_WORLD_SIZE), or set FERRY_TOPOLOGY=NxM");
  return {world / local_world, local_world};
}

namespace detail {
namespace {

// One rank's topology as the ranks exchange it: the resolved one (nodes 0: refused), how it was set, and the
// refusal's reason.
struct TopologyVote {
  int32_t nodes = 0;
  int32_t local = 0;
  char setting[88] = {};
  char problem[416] = {};
};
static_assert(sizeof(TopologyVote) == 512, "a fixed record of the exchange");

template <std::size_t N>
void copy_text(char (&to)[N], std::string const& text) {
  std::size_t const n = std::min(text.size(), N - 1);
  std::memcpy(to, text.data(), n);
  to[n] = '\0';
}

}  // namespace

Topology agree_on_topology(Bootstrap& bootstrap, std::string const& options_topology,
                           std::function<void(Topology const&)> const& check) {
  int const world = bootstrap.world();
  std::string const forced = options_topology.empty() ? env_string("FERRY_TOPOLOGY") : options_topology;
  TopologyVote mine;
  copy_text(mine.setting, !options_topology.empty() ? concat("topology=", options_topology, " (CommunicatorOptions)")
                          : !forced.empty()         ? concat("FERRY_TOPOLOGY=", forced)
                                                    : concat("FERRY_TOPOLOGY unset, ", bootstrap.local_world(),
                                                             " ranks per host (LOCAL_WORLD_SIZE)"));
  Topology topology;
  std::string own_error;
  try {
    topology = topology_of(world, bootstrap.local_world(), forced);
    if (check) check(topology);
    mine.nodes = topology.nodes;
    mine.local = topology.local;
  } catch (ConfigError const& error) {
    own_error = error.what();
    copy_text(mine.problem, own_error);
  }
  std::vector<TopologyVote> all(static_cast<std::size_t>(world));
  bootstrap.allgather(&mine, all.data(), sizeof(TopologyVote));
  if (!own_error.empty()) throw ConfigError(own_error);
  // 1. a rank that refused its own setting: every other rank names it (and each such rank's reason)
  std::string refused;
  for (int r = 0; r < world; ++r)
    if (TopologyVote const& theirs = all[static_cast<std::size_t>(r)]; theirs.nodes == 0)
      refused += concat(refused.empty() ? "" : "; ", "rank ", r, " (", theirs.setting, "): ", theirs.problem);
  FERRY_CHECK_CONFIG(refused.empty(),
                     "the topology of another rank is refused, so no rank creates this communicator: ", refused);
  // 2. every rank the same topology, or every rank lists which ranks hold which setting
  std::vector<std::pair<std::string, std::vector<int>>> settings;  // "FERRY_TOPOLOGY=2x2 (2x2)", its ranks
  bool same = true;
  for (int r = 0; r < world; ++r) {
    TopologyVote const& theirs = all[static_cast<std::size_t>(r)];
    same = same && theirs.nodes == topology.nodes && theirs.local == topology.local;
    std::string const text = concat(theirs.setting, ": ", theirs.nodes, "x", theirs.local);
    auto const at = std::find_if(settings.begin(), settings.end(), [&](auto const& s) { return s.first == text; });
    if (at == settings.end())
      settings.push_back({text, {r}});
    else
      at->second.push_back(r);
  }
  if (same) return topology;
  std::string listed;
  for (auto const& [text, ranks] : settings)
    listed += concat(listed.empty() ? "" : "; ", describe_ranks(ranks), " ", text);
  FERRY_THROW(ConfigError, "config", "the ranks disagree on the world's topology (", listed,
              "), so no rank creates this communicator: set the same FERRY_TOPOLOGY on every rank, or leave it unset "
              "on every rank");
}

}  // namespace detail
}  // namespace ferry
