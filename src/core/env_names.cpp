// FERRY_* names set in the environment that Ferry does not read (include/ferry/env.hpp, unknown_env_warnings).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/log.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

extern char** environ;

namespace ferry {
namespace {

// Variables of the FERRY_ namespace read by the scripts and the Python package, not by the library: setting one is no
// mistake.
// (tests/unit/test_env_names.cpp checks that every FERRY_* name the scripts read is here or in the env table.)
constexpr char const* kScriptNames[] = {
    "FERRY_VENV",              // scripts/python-tests.sh: where the test environment lives
    "FERRY_CTEST_JUNIT",       // scripts/python-tests.sh: ctest's results, for pytest's "skipped:" summary
    "FERRY_PYTEST_JUNIT",      // scripts/python-tests.sh: where pytest writes its results (make test's summary)
    "FERRY_PYTEST_PRELOAD",    // make test-sanitize: the sanitizers' runtimes, preloaded into pytest
    "FERRY_BUILD_DIR",         // scripts/gpu-check.sh: its build folder
    "FERRY_ENABLE_CUDA",       // scripts/gpu-check.sh python: the CMake option of its build
    "FERRY_CUDA_ARCH",         // scripts/gpu-check.sh: --arch's default
    "FERRY_NCCL_ROOT",         // scripts/gpu-check.sh: --nccl-root's default
    "FERRY_WIDE_TOPOLOGIES",   // make test-wide: the topologies of tests/wide
    "FERRY_DEEP_EP",           // the Python package: `import deep_ep` resolves to ferry.deep_ep (docs/deep_ep.md)
    "FERRY_DEEPEP_TIMEOUT_S",  // tools/dev/run-deepep-tests.sh: each DeepEP test program's time limit
    "FERRY_DEEPEP_WORLDS",     // tools/dev/run-deepep-tests.sh: the worlds it runs
    "FERRY_DEEPEP_ONLY",       // tools/dev/run-deepep-tests.sh: the programs it runs
};
constexpr std::string_view kTestPrefix = "FERRY_TEST_";  // the tests' own (FERRY_TEST_SEED, FERRY_TEST_WORLD, ...)

bool known(std::string_view name) {
  if (name.substr(0, kTestPrefix.size()) == kTestPrefix) return true;
  for (EnvParam const& param : env_params())
    if (name == param.name) return true;
  for (RemovedEnvParam const& param : removed_env_params())
    if (name == param.name) return true;
  return std::any_of(std::begin(kScriptNames), std::end(kScriptNames), [&](char const* n) { return name == n; });
}

// Edits (insert, delete, substitute, swap two neighbours) that turn a into b.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// The declared name closest to `name`, if it is close enough to be a slip (at most 3 edits, and fewer than a third of
// the name's letters): "" otherwise.
std::string closest_declared(std::string_view name) {
  std::string best;
  std::size_t best_distance = std::min<std::size_t>(3, name.size() / 3) + 1;
  for (EnvParam const& param : env_params()) {
    if (std::strncmp(param.name, "FERRY_", 6) != 0) continue;  // the torchrun variables are not FERRY_ names
    std::size_t const distance = edit_distance(name, param.name);
    if (distance < best_distance) {
      best_distance = distance;
      best = param.name;
    }
  }
  return best;
}

}  // namespace

std::vector<std::string> unknown_env_warnings() {
  std::vector<std::string> out;
  for (char** entry = environ; entry && *entry; ++entry) {
    std::string_view const text = *entry;
    std::string_view const name = text.substr(0, text.find('='));
    if (name.substr(0, 6) != "FERRY_" || known(name)) continue;
    std::string const close = closest_declared(name);
    out.push_back(detail::concat(name, " is set, but Ferry reads no variable of that name",
                                 close.empty() ? "" : detail::concat(" (did you mean ", close, "?)"),
                                 "; `ferry env` lists the ones it reads"));
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace detail {

// check_env's warnings: once per process, from the first process of each host (the other ranks there share its
// environment when one launcher started them all).
void warn_unknown_env_names() {
  static bool const warned = [] {
    char const* local_rank = std::getenv("LOCAL_RANK");
    if (local_rank && *local_rank && std::strcmp(local_rank, "0") != 0) return true;
    for (std::string const& warning : unknown_env_warnings()) FERRY_LOG_WARN(warning);
    return true;
  }();
  (void)warned;
}

}  // namespace detail
}  // namespace ferry
