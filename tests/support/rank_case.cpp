#include "support/rank_case.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <random>

#include "ferry/bootstrap.hpp"
#include "ferry/error.hpp"

namespace ferry::test {
namespace {

std::map<std::string, RankCaseFn>& registry() {
  static std::map<std::string, RankCaseFn> cases;
  return cases;
}

std::vector<std::string>& args_storage() {
  static std::vector<std::string> args;
  return args;
}

constexpr char kFlag[] = "--ferry-rank-case=";

}  // namespace

RankCaseRegistrar::RankCaseRegistrar(char const* name, RankCaseFn fn) {
  registry()[name] = fn;
}

std::vector<std::string> const& rank_case_args() {
  return args_storage();
}

uint64_t test_seed() {
  static uint64_t const seed = [] {
    uint64_t value;
    if (char const* pinned = std::getenv("FERRY_TEST_SEED"); pinned && *pinned) {
      value = static_cast<uint64_t>(std::strtoull(pinned, nullptr, 0));
    } else {
      std::random_device device;
      value = (static_cast<uint64_t>(device()) << 32) ^ device();
    }
    std::printf("test seed %llu (FERRY_TEST_SEED=%llu replays it)\n", static_cast<unsigned long long>(value),
                static_cast<unsigned long long>(value));
    return value;
  }();
  return seed;
}

uint64_t seed_arg() {
  for (std::string const& arg : rank_case_args())
    if (arg.rfind("--seed=", 0) == 0) return std::stoull(arg.substr(7));
  FERRY_THROW(Error, "test", "rank case started without --seed=");
}

std::shared_ptr<Communicator> connect_rank(Backend backend) {
  return Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()),
                              CommunicatorOptions{backend, -1});
}

LaunchResult run_rank_case(char const* name, int nproc, RankCaseOptions const& options) {
  LaunchOptions launch;
  launch.argv = {self_executable(), std::string(kFlag) + name};
  launch.argv.insert(launch.argv.end(), options.args.begin(), options.args.end());
  launch.nproc = nproc;
  launch.env = options.env;
  launch.timeout = options.timeout;
  return launch_ranks(launch);
}

int test_main(int argc, char** argv) {
  if (argc >= 2 && std::strncmp(argv[1], kFlag, sizeof(kFlag) - 1) == 0) {
    std::string const name = argv[1] + sizeof(kFlag) - 1;
    for (int i = 2; i < argc; ++i) args_storage().emplace_back(argv[i]);
    auto const found = registry().find(name);
    if (found == registry().end()) {
      std::fprintf(stderr, "unknown rank case %s\n", name.c_str());
      return 2;
    }
    try {
      return found->second();
    } catch (std::exception const& error) {
      std::fprintf(stderr, "rank case %s failed: %s\n", name.c_str(), error.what());
      return 1;
    }
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

}  // namespace ferry::test

int main(int argc, char** argv) {
  return ferry::test::test_main(argc, argv);
}
