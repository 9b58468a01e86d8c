// scripts/gpu-check.sh without a GPU: its help, its refusals of bad usage, the plan of `all` (--dry-run), the GPU-test
// runner on a stand-in test binary (status per test, resume, the fast-path walk last), and a whole `ab` on the cpu
// backend between this build's CLI and itself, whose table must be the medians of the runs' records. The GPU runs
// themselves are the script's to make; this keeps its parsing, its bookkeeping and its tables from rotting in CI.
// Checked to fail, each once: a default architecture of 90 (the plan), a skip read as a pass (the runner), rounds
// that always start with side A (the interleaving) and means in place of medians (the A/B table).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "core/util/json.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

// The script's interpreter lookup would import torch to find it; these runs need python3 only (the tables).
class GpuCheckScript : public testing::Test {
  ScopedEnv python_{"PYTHON", std::string("python3")};
  ScopedEnv rank_{"RANK", std::nullopt};
  ScopedEnv world_{"FERRY_TEST_WORLD", std::nullopt};
};

// Runs `scripts/gpu-check.sh ARGS` from the source tree, stdout and stderr together.
CliRun run_script(std::string const& args) {
  return run_shell(std::string("cd ") + FERRY_SOURCE_DIR + " && scripts/gpu-check.sh " + args);
}

std::vector<std::string> const kCommands = {"all",    "build",     "test",  "example", "bench", "ab",         "p2p",
                                            "python", "internode", "scale", "tune",    "pack",  "run-packed", "report"};

TEST_F(GpuCheckScript, HelpNamesEveryCommandAndEachCommandHasItsOwn) {
  CliRun const help = run_script("--help");
  ASSERT_EQ(help.code, 0) << help.output;
  for (std::string const& command : kCommands)
    EXPECT_TRUE(contains(help.output, "  " + command + " ")) << command << " missing from:\n" << help.output;
  EXPECT_TRUE(contains(help.output, "NCCL_NVLS_ENABLE=0")) << help.output;
  for (std::string const& command : kCommands) {
    CliRun const own = run_script(command + " --help");
    EXPECT_EQ(own.code, 0) << command << ":\n" << own.output;
    EXPECT_TRUE(contains(own.output, "usage: scripts/gpu-check.sh " + command + " ")) << command << ":\n" << own.output;
  }
}

TEST_F(GpuCheckScript, BadUseIsRefusedWithExitTwoNamingWhatIsWrong) {
  TempDir const dir;
  std::string const out = dir.file("out");
  struct Refusal {
    std::string args;
    std::string says;
  };
  for (Refusal const& c : std::vector<Refusal>{
           {"", "usage: scripts/gpu-check.sh COMMAND OUT_DIR"},
           {"frobnicate " + out, "unknown command 'frobnicate'"},
           {"all", "give an output folder"},
           {"all --dry-run", "give an output folder"},
           {"all " + out + " --frob", "unknown option '--frob' (see all --help)"},
           {"bench " + out + " --iters many", "--iters needs a number (got 'many')"},
           {"test " + out + " --resume " + dir.file("none"), "--resume " + dir.file("none") + ": no such file"},
           {"build " + out + " --jobs 0", "--jobs=0 must be a positive number"},
           {"ab " + out, "give side A: --base SPEC"},
           {"ab " + out + " --base /nonexistent-ferry-side", "side a: '/nonexistent-ferry-side' is not a commit"},
           {"ab " + out + " --base . --side bb=.", "one lower-case letter (got 'bb')"},
           {"ab " + out + " --base . --side c=@d", "side c: @d is not a side with a CLI of its own"},
           {"ab " + out + " --base . --host-only", "--host-only needs --host-time"},
           {"tune " + out + " --shapes llama --dry-run", "--shapes: 'llama' is not one of"},
           {"run-packed " + out, "give the packed binaries: --pack PACK_DIR"},
       }) {
    CliRun const run = run_script(c.args);
    EXPECT_EQ(run.code, 2) << c.args << "\n" << run.output;
    EXPECT_TRUE(contains(run.output, c.says)) << c.args << ": '" << c.says << "' not in:\n" << run.output;
  }
}

// `all` on a fresh machine: a Release build for sm_90a, every GPU test, the example and a short checked bench, with
// NVLink multicast off; --arch and FERRY_CUDA_ARCH change the architecture.
TEST_F(GpuCheckScript, AllPlansTheBuildTheTestsTheExampleAndACheckedBench) {
  TempDir const dir;
  CliRun const run = run_script("all " + dir.file("out") + " --dry-run --build " + dir.file("build"));
  ASSERT_EQ(run.code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1"))
      << run.output;
  EXPECT_TRUE(
      std::regex_search(run.output, std::regex("\\[dry-run\\] cmake -S \\. -B \\S+ .*-DCMAKE_BUILD_TYPE=Release "
                                               "-DFERRY_CUDA_ARCH=90a")))
      << run.output;
  EXPECT_TRUE(contains(run.output, "[dry-run] cmake --build ")) << run.output;
  EXPECT_TRUE(contains(run.output, "tests/ferry_gpu_tests --gtest_list_tests")) << run.output;
  EXPECT_TRUE(contains(run.output, "[dry-run] tests/install/consume.sh ")) << run.output;
  EXPECT_TRUE(std::regex_search(run.output, std::regex("\\[dry-run\\] \\S+/ferry bench .*--graph --check")))
      << run.output;
  for (char const* step : {"build ", "tests ", "example ", "bench "})
    EXPECT_TRUE(std::regex_search(run.output, std::regex(std::string("\n  ") + step + " *ok"))) << step << run.output;
  EXPECT_TRUE(contains(read_file(dir.file("out/status")), "bench\tok\t")) << "the status file";

  CliRun const arch = run_script("build " + dir.file("out") + " --dry-run --arch 100a");
  EXPECT_TRUE(contains(arch.output, "-DFERRY_CUDA_ARCH=100a")) << arch.output;
  ScopedEnv const env{"FERRY_CUDA_ARCH", std::string("90a-real")};
  CliRun const from_env = run_script("build " + dir.file("out") + " --dry-run --nccl-root /opt/nccl");
  EXPECT_TRUE(contains(from_env.output, "-DFERRY_CUDA_ARCH=90a-real")) << from_env.output;
  EXPECT_TRUE(contains(from_env.output, "-DFERRY_NCCL_ROOT=/opt/nccl")) << from_env.output;
}

// A stand-in for ferry_gpu_tests (gtest's listing and filter): Pass.* pass, Fail.One fails, Skip.One skips, a
// disabled test, and the fast-path walk listed first. The runner must run them one by one, walk last, and keep a
// status per test; --resume must not run again what passed or skipped.
TEST_F(GpuCheckScript, TestRunnerKeepsAStatusPerTestAndResumes) {
  TempDir const dir;
  std::string const bin = dir.file("fake_gpu_tests");
  std::string const ran = dir.file("ran.txt");
  write_file(
      bin,
      "#!/usr/bin/env bash\n"
      "case \"$1\" in\n"
      "  --gtest_list_tests) printf 'FastPathVirtualRanks.\\n  Walk\\nPass.\\n  One\\n  Two\\n  DISABLED_Three\\n"
      "Fail.\\n  One\\nSkip.\\n  One\\n' ;;\n"
      "  --gtest_filter=*) name=${1#--gtest_filter=}; echo \"$name\" >> " +
          ran +
          "\n"
          "    case $name in Fail.*) echo 'x.cu:1: Failure'; exit 1 ;; Skip.*) echo '[  SKIPPED ] no GPU' ;; "
          "esac ;;\n"
          "esac\n");
  std::filesystem::permissions(bin, std::filesystem::perms::owner_all);
  std::string const out = dir.file("out");
  CliRun const first = run_script("test " + out + " --bin " + bin);
  EXPECT_EQ(first.code, 1) << first.output;  // Fail.One
  std::string const status = read_file(out + "/tests/status");
  for (char const* line : {"Pass.One\tpassed\t", "Pass.Two\tpassed\t", "Pass.DISABLED_Three\tdisabled\t",
                           "Fail.One\tfailed\t", "Skip.One\tskipped\t", "FastPathVirtualRanks.Walk\tpassed\t"})
    EXPECT_TRUE(contains(status, line)) << line << " not in:\n" << status;
  EXPECT_EQ(read_file(ran), "Pass.One\nPass.Two\nFail.One\nSkip.One\nFastPathVirtualRanks.Walk\n");
  EXPECT_TRUE(contains(first.output, "3 passed, 1 failed, 1 skipped, 0 left out by the budget (of 5; 1 disabled)"))
      << first.output;
  EXPECT_TRUE(contains(first.output, "x.cu:1: Failure")) << first.output;

  std::filesystem::copy_file(out + "/tests/status", dir.file("earlier.status"));
  std::filesystem::remove(ran);
  CliRun const resumed = run_script("test " + dir.file("out2") + " --bin " + bin + " --resume " +
                                    dir.file("earlier.status") + " --tests 'Pass.*:Fail.*:Skip.*'");
  EXPECT_EQ(resumed.code, 1) << resumed.output;
  EXPECT_EQ(read_file(ran), "Fail.One\n") << "only the failed test runs again";
  EXPECT_TRUE(contains(read_file(dir.file("out2/tests/status")), "Pass.One\tpassed\t0\tearlier run"));
}

std::map<std::string, std::vector<double>> medians_by_leg(std::string const& file) {
  std::map<std::string, std::vector<double>> out;
  util::json::Value const doc = util::json::parse(read_file(file), file);
  for (util::json::Value const& r : doc.find("records")->items)
    out[r.find("leg")->text + " " + r.find("tokens")->text + " " + r.find("dispatch_format")->text].push_back(
        r.find("median_us")->number);
  return out;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A whole A/B on the cpu backend: this build's CLI as A, and as B with an environment of its own, three rounds
// interleaved. Every run leaves its records; the table's A and B columns are the medians over the rounds, its ratio
// B / A; `report` prints the same table again.
TEST_F(GpuCheckScript, AbOnTheCpuBackendTabulatesTheMediansOfItsRounds) {
  TempDir const dir;
  std::string const out = dir.file("out");
  CliRun const run = run_script(std::string("ab ") + out + " --build " + dir.file("build") + " --base " +
                                FERRY_CLI_PATH + " --side b=@a,FERRY_LOG=warn --rounds 3 --iters 2 --flags --check" +
                                " --runs '--backend cpu --nproc 2 --tokens 8 --hidden 256 --dispatch bf16,fp8" +
                                " --combine bf16,fp8'");
  ASSERT_EQ(run.code, 0) << run.output;
  // the rounds interleaved: round 2 starts with B
  std::vector<std::pair<std::filesystem::file_time_type, std::string>> order;
  for (auto const& entry : std::filesystem::directory_iterator(out + "/ab/runs"))
    if (entry.path().extension() == ".json") order.emplace_back(entry.last_write_time(), entry.path().stem().string());
  std::sort(order.begin(), order.end());
  ASSERT_EQ(order.size(), 6u);
  std::vector<std::string> names;
  for (auto const& [time, name] : order) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"a-1-0", "b-1-0", "b-2-0", "a-2-0", "a-3-0", "b-3-0"}));
  // a table row: its A and B medians and their ratio, from the records of the three rounds
  std::map<std::string, std::vector<double>> a, b;
  for (int round = 1; round <= 3; ++round) {
    for (auto const& [leg, values] : medians_by_leg(out + "/ab/runs/a-" + std::to_string(round) + "-0.json"))
      a[leg].insert(a[leg].end(), values.begin(), values.end());
    for (auto const& [leg, values] : medians_by_leg(out + "/ab/runs/b-" + std::to_string(round) + "-0.json"))
      b[leg].insert(b[leg].end(), values.begin(), values.end());
  }
  std::string const table = read_file(out + "/ab/table.txt");
  ASSERT_EQ(a.size(), 4u);
  for (auto const& [key, values] : a) {
    std::istringstream words(key);
    std::string leg, tokens, format;
    words >> leg >> tokens >> format;
    char expected[160];
    double const ma = median_of(values), mb = median_of(b[key]);
    std::snprintf(expected, sizeof(expected), "normal  rank    %-17s %6s %-9s %-9s %8.2f %8.2f %6.3f", leg.c_str(),
                  tokens.c_str(), format.c_str(), format.c_str(), ma, mb, mb / ma);
    EXPECT_TRUE(contains(table, expected)) << "'" << expected << "' not in:\n" << table;
  }
  EXPECT_TRUE(contains(table, "checks: A ['pass'], B ['pass']")) << table;
  EXPECT_TRUE(contains(table, "B: side a's CLI, with FERRY_LOG=warn")) << table;
  EXPECT_TRUE(contains(run.output, table.substr(0, table.find('\n')))) << run.output;

  CliRun const report = run_script("report " + out);
  EXPECT_EQ(report.code, 0) << report.output;
  EXPECT_TRUE(contains(report.output, table)) << report.output;
}

}  // namespace
}  // namespace ferry::test
