// FERRY_* names Ferry does not read (src/core/env_names.cpp): a misspelt variable is named, with the one it may have
// meant, by `ferry env` and where a job starts (check_env), instead of changing nothing in silence. Before the
// warning, FERRY_TIMOUT_S=5 gave no sign at all: these tests failed so.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "ferry/env.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

std::string joined(std::vector<std::string> const& lines) {
  std::string out;
  for (std::string const& line : lines) out += line + "\n";
  return out;
}

TEST(EnvNames, AMisspeltNameIsNamedWithTheClosestOne) {
  std::size_t const before = unknown_env_warnings().size();  // what the test's own environment holds
  ScopedEnv const typo("FERRY_TIMOUT_S", "5");
  ScopedEnv const swapped("FERRY_LGO", "info");
  ScopedEnv const far("FERRY_SOMETHING_ELSE", "1");
  std::string const warnings = joined(unknown_env_warnings());
  EXPECT_TRUE(contains(warnings,
                       "FERRY_TIMOUT_S is set, but Ferry reads no variable of that name (did you mean "
                       "FERRY_TIMEOUT_S?)"))
      << warnings;
  EXPECT_TRUE(
      contains(warnings, "FERRY_LGO is set, but Ferry reads no variable of that name (did you mean FERRY_LOG?)"))
      << warnings;
  EXPECT_TRUE(contains(warnings, "FERRY_SOMETHING_ELSE is set, but Ferry reads no variable of that name; `ferry env`"))
      << warnings;
  EXPECT_EQ(unknown_env_warnings().size(), before + 3) << warnings;

  CliRun const run = run_ferry("env");
  EXPECT_EQ(run.code, 0) << run.output;  // a warning: only refusals change the exit status
  EXPECT_TRUE(contains(run.output, "ferry env: warning: FERRY_TIMOUT_S is set")) << run.output;
  CliRun const bench = run_ferry("model --topology 1x2 --tokens 1");
  EXPECT_EQ(bench.code, 0) << bench.output;
  EXPECT_TRUE(contains(bench.output, "ferry warn [rank -]: FERRY_TIMOUT_S is set")) << bench.output;
}

TEST(EnvNames, DeclaredRemovedScriptAndTestNamesAreNotWarnedAbout) {
  std::string const before = joined(unknown_env_warnings());  // what the test's own environment holds
  ScopedEnv const declared("FERRY_TIMEOUT_S", "5");
  ScopedEnv const removed("FERRY_DISPATCH_WARPS", "");
  ScopedEnv const script("FERRY_VENV", "/tmp/venv");
  ScopedEnv const test("FERRY_TEST_ANYTHING", "1");
  ScopedEnv const other("NOT_FERRY_TIMOUT_S", "1");
  EXPECT_EQ(joined(unknown_env_warnings()), before);
}

// Every FERRY_* variable a script, the Makefile or a Python file of this repository reads is one the library knows
// (declared, or listed as a script's own in src/core/env_names.cpp), so that setting it never warns.
TEST(EnvNames, EveryNameTheScriptsReadIsKnown) {
  std::regex const read_in_shell(R"(\$\{?(FERRY_[A-Z0-9_]+))");
  std::regex const read_in_python(R"(environ(?:\.get\(|\[)\s*"(FERRY_[A-Z0-9_]+))");
  std::regex const named_in_python(
      R"re((?:^|\n)[A-Z_]+ = "(FERRY_[A-Z0-9_]+)")re");  // ENV = "FERRY_..." (then environ[ENV])
  std::set<std::string> names;
  namespace fs = std::filesystem;
  for (fs::path const folder : {"scripts", "python", "examples", "tools", ".ci"}) {
    for (auto const& entry : fs::recursive_directory_iterator(fs::path(FERRY_SOURCE_DIR) / folder)) {
      if (!entry.is_regular_file()) continue;
      // CMake's ${FERRY_...} are its variables, not the environment's
      if (entry.path().filename() == "CMakeLists.txt" || entry.path().extension() == ".cmake") continue;
      std::string const text = read_file(entry.path().string());
      for (std::regex const* pattern : {&read_in_shell, &read_in_python, &named_in_python})
        for (std::sregex_iterator it(text.begin(), text.end(), *pattern), end; it != end; ++it)
          names.insert((*it)[1].str());
    }
  }
  std::string const makefile = read_file(std::string(FERRY_SOURCE_DIR) + "/Makefile");
  for (std::sregex_iterator it(makefile.begin(), makefile.end(), read_in_shell), end; it != end; ++it)
    names.insert((*it)[1].str());
  ASSERT_TRUE(names.count("FERRY_VENV")) << "the scan found nothing: the patterns no longer match the scripts";
  ASSERT_TRUE(names.count("FERRY_DEEP_EP")) << "the scan missed python/_ferry_deep_ep.py's ENV = \"FERRY_DEEP_EP\"";
  std::string const before = joined(unknown_env_warnings());
  for (std::string const& name : names) {
    ScopedEnv const set(name.c_str(), "1");
    EXPECT_EQ(joined(unknown_env_warnings()), before) << name << " is read by a script but not known to the library";
  }
}

}  // namespace
}  // namespace ferry::test
