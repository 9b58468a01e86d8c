// What a new user sees first: `ferry --version`, errors that come before any output, and the cuda backend on a machine
// without a GPU.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/error.hpp"
#include "ferry/version.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

// The CLI and the library report the version of CMakeLists.txt's project(VERSION) (the Python tests compare it with
// ferry.__version__, the CMake package's and the wheel's: python/tests/test_version.py).
TEST(CliMessages, VersionIsTheLibrarysVersion) {
  EXPECT_STREQ(version(), FERRY_VERSION);
  for (char const* args : {"--version", "version"}) {
    CliRun const run = run_ferry(args);
    EXPECT_EQ(run.code, 0) << args << "\n" << run.output;
    EXPECT_EQ(run.output.rfind(std::string("ferry ") + version() + " (", 0), 0u) << args << "\n" << run.output;
    EXPECT_EQ(run.output.find('\n'), run.output.size() - 1) << "one line:\n" << run.output;
  }
}

// A refused option is the only output: nothing on stdout before the error (the table's header came first for a
// topology the model refuses, 3x3 with 256 experts).
TEST(CliMessages, ModelRefusesBeforePrintingAnything) {
  TempDir const dir;
  for (char const* args : {"model --topology 3x3", "model --topology 2x4 --tokens 128,-1"}) {
    CliRun const run =
        run_ferry(std::string(args) + " > " + dir.file("stdout") + " 2> " + dir.file("stderr") + "; exit $?");
    std::string const error = read_file(dir.file("stderr"));
    EXPECT_EQ(run.code, 2) << args << "\n" << error;
    EXPECT_TRUE(contains(error, "ferry model: config error")) << args << "\n" << error;
    EXPECT_EQ(read_file(dir.file("stdout")), "") << args;
  }
  CliRun const good = run_ferry("model --topology 2x4 --tokens 128 > " + dir.file("stdout"));
  EXPECT_EQ(good.code, 0) << good.output;
  EXPECT_TRUE(contains(read_file(dir.file("stdout")), "2x4")) << "the check above needs a model that prints";
}

// The cuda backend without a GPU says so (the CUDA runtime's own answer without a driver is
// cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version", which this said
// before).
TEST(CliMessages, CudaBackendWithoutAGpuSaysThereIsNone) {
  if (!FERRY_HAVE_CUDA) GTEST_SKIP() << "built without the cuda backend";
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU";
  try {
    Communicator::create(std::move(make_local_bootstraps(1)[0]), {.backend = Backend::cuda});
    ADD_FAILURE() << "Communicator::create(cuda) on a machine without a GPU did not throw";
  } catch (CudaError const& error) {
    std::string const what = error.what();
    EXPECT_TRUE(contains(what, "backend cuda needs a GPU, and this process sees none")) << what;
    EXPECT_FALSE(contains(what, "InsufficientDriver")) << what;
  }
}

}  // namespace
}  // namespace ferry::test
