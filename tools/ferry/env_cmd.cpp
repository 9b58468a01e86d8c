#include <cstdio>
#include <cstdlib>
#include <string>

#include "commands.hpp"
#include "ferry/env.hpp"
#include "options.hpp"

namespace ferry::cli {

int env_main(int argc, char** argv) {
  Options options("env", "Lists every environment parameter Ferry reads, its default, the value in force, and meaning.",
                  {});
  if (!options.parse(argc, argv)) return 0;
  std::printf("%-28s %-10s %-12s %s\n", "variable", "default", "in force", "meaning");
  for (EnvParam const& param : env_params()) {
    char const* set = std::getenv(param.name);
    std::string const value = (set && *set) ? set : "(default)";
    std::printf("%-28s %-10s %-12s %s\n", param.name, *param.default_value ? param.default_value : "-", value.c_str(),
                param.meaning);
  }
  return 0;
}

}  // namespace ferry::cli
