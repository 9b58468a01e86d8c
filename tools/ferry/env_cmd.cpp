#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.hpp"
#include "ferry/env.hpp"
#include "options.hpp"

namespace ferry::cli {

int env_main(int argc, char** argv) {
  Options options(
      "env",
      "Lists every environment parameter Ferry reads, its default, the value in force, and meaning. A value "
      "the library refuses is marked 'refused' and its refusal printed after the table (exit status 1), as is a "
      "variable Ferry no longer reads that is set. A FERRY_* variable Ferry does not know (a misspelt name) is "
      "named after the table with the closest one it reads.",
      {});
  if (!options.parse(argc, argv)) return 0;
  std::printf("%-28s %-10s %-12s %s\n", "variable", "default", "in force", "meaning");
  std::vector<std::string> refusals;
  for (EnvParam const& param : env_params()) {
    char const* set = std::getenv(param.name);
    std::string value = (set && *set) ? set : "(default)";
    // NOTE: the rule the accessors apply (env_problem), so this flags exactly what the library refuses.
    if (std::string const problem = env_problem(param, set ? set : ""); !problem.empty()) {
      value += " (refused)";
      refusals.push_back(problem);
    }
    std::printf("%-28s %-10s %-12s %s\n", param.name, *param.default_value ? param.default_value : "-", value.c_str(),
                param.meaning);
  }
  for (RemovedEnvParam const& param : removed_env_params()) {
    char const* set = std::getenv(param.name);
    if (std::string const problem = removed_env_problem(param, set ? set : ""); !problem.empty())
      refusals.push_back(problem);
  }
  std::fflush(stdout);
  for (std::string const& refusal : refusals) std::fprintf(stderr, "ferry env: refused: %s\n", refusal.c_str());
  // A name Ferry does not read is ignored, not refused (a warning; the exit status says only what is refused).
  for (std::string const& warning : unknown_env_warnings())
    std::fprintf(stderr, "ferry env: warning: %s\n", warning.c_str());
  return refusals.empty() ? 0 : 1;
}

}  // namespace ferry::cli
