// EpConfig validation, wire-format sizes, the env table, and the error format: every rule's message names the
// field, the value and what is allowed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "ep/ep_impl.hpp"
#include "ferry/env.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"

namespace ferry {
namespace {

// Runs validate and returns the ConfigError message ("" if it passed).
std::string config_error(EpConfig const& config, int world) {
  try {
    config.validate(world);
  } catch (ConfigError const& error) {
    return error.what();
  }
  return "";
}

void expect_message(EpConfig const& config, int world, std::initializer_list<char const*> parts) {
  std::string const message = config_error(config, world);
  ASSERT_FALSE(message.empty()) << "expected a ConfigError";
  for (char const* part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  EXPECT_EQ(message.rfind("config error (", 0), 0u) << message;
}

TEST(Config, DefaultsAreValidForCommonWorlds) {
  for (int world : {1, 2, 4, 8}) EXPECT_EQ(config_error(EpConfig{}, world), "") << "world " << world;
}

TEST(Config, ExpertsNotDivisibleByWorld) {
  EpConfig config;
  config.num_experts = 255;
  expect_message(config, 4, {"num_experts=255", "not divisible by the world size 4", "256"});
}

TEST(Config, HiddenNotMultipleOf16Bytes) {
  EpConfig config;
  config.hidden = 7004;
  expect_message(config, 2, {"hidden=7004", "16 bytes", "7008"});
}

TEST(Config, TopkRules) {
  EpConfig config;
  config.topk = 0;
  expect_message(config, 2, {"topk=0", "[1, 16]"});
  config.topk = kMaxTopk + 1;
  expect_message(config, 2, {"topk=17", "[1, 16]"});
  config.topk = 9;
  config.num_experts = 8;
  expect_message(config, 2, {"topk=9", "num_experts=8"});
  static_assert(kMaxTopk >= 16, "the issue requires a supported topk of at least 16");
}

TEST(Config, TokensAndCaps) {
  EpConfig config;
  config.max_tokens_per_rank = 0;
  expect_message(config, 2, {"max_tokens_per_rank=0"});
  config = EpConfig{};
  config.max_recv_tokens = 0;
  expect_message(config, 2, {"max_recv_tokens=0"});
  config = EpConfig{};
  config.expert_capacity = -3;
  expect_message(config, 2, {"expert_capacity=-3"});
  config = EpConfig{};
  EXPECT_EQ(config.recv_capacity(2), 2 * config.max_tokens_per_rank);
  config.max_recv_tokens = 100;
  EXPECT_EQ(config.recv_capacity(2), 100);
  EXPECT_EQ(config.expert_slots(), 0);
  config.expert_capacity = 64;
  EXPECT_EQ(config.expert_slots(), 64);
}

TEST(Config, GeometryAndWorld) {
  EpConfig config;
  config.dispatch_geometry = Geometry{-1};
  expect_message(config, 2, {"dispatch_geometry.blocks=-1"});
  config.combine_geometry = Geometry{-2};
  config.dispatch_geometry = Geometry{8};
  expect_message(config, 2, {"combine_geometry.blocks=-2"});
  // mode=ll runs both legs on the dispatch grid: a combine pin would do nothing, so it is refused
  config.combine_geometry = Geometry{4};
  config.mode = Mode::low_latency;
  config.max_tokens_per_rank = 128;
  expect_message(config, 2, {"combine_geometry.blocks=4 is not used by mode=ll"});
  config.combine_geometry = Geometry{0};
  EXPECT_NO_THROW(config.validate(2));
  config.mode = Mode::normal;
  config.max_tokens_per_rank = EpConfig{}.max_tokens_per_rank;
  expect_message(EpConfig{}, 0, {"world=0"});
  config = EpConfig{};
  config.num_experts = 1025 * 4;
  expect_message(config, 1025, {"world=1025", "[1, 1024]", "kMaxWorld"});
}

// The world bound (kMaxWorld: 128 nodes x 8) and the token bound derived from it: a rank receives up to world x
// max_tokens_per_rank rows of topk entries, indexed with int32.
TEST(Config, WorldsUpToTheBoundAndTheirTokenBound) {
  EpConfig config;
  config.topk = 16;
  for (int world : {33, 64, 256, 1024}) {
    config.num_experts = world * 16;
    EXPECT_EQ(config_error(config, world), "") << "world " << world;
  }
  config.max_tokens_per_rank = 1 << 19;  // 256 x 2^19 x 16 = 2^31: one entry too many for int32
  expect_message(config, 256, {"max_tokens_per_rank=524288", "outside [1, 524287]", "world=256", "topk=16", "int32"});
  config.max_tokens_per_rank = (1 << 19) - 1;
  EXPECT_EQ(config_error(config, 256), "");
  EXPECT_EQ(config_error(config, 32), "");
  config.max_tokens_per_rank = 1 << 17;  // 1024 x 2^17 x 16 = 2^31
  expect_message(config, 1024, {"max_tokens_per_rank=131072", "outside [1, 131071]", "world=1024", "int32"});
  config.max_tokens_per_rank = (1 << 17) - 1;
  EXPECT_EQ(config_error(config, 1024), "");
  config.max_tokens_per_rank = (1 << 20) + 1;  // the bound at any world
  expect_message(config, 1, {"max_tokens_per_rank=1048577", "outside [1, 1048576]"});
}

// The cuda backend's EpBuffer refuses, at construction, a world its kernels cannot address: past 32 ranks only
// low-latency mode across nodes runs (its kernels' rank sets are sized for kMaxWorld), without rank masking (its
// agreement keeps one 32-bit word). The check is host code, called first by make_cuda_ep.
TEST(Config, CudaBackendRefusesAWorldPastItsKernels) {
  auto const refusal = [](EpConfig const& config, Topology const& topology) -> std::string {
    try {
      detail::check_cuda_world(config, topology);
    } catch (ConfigError const& error) {
      return error.what();
    }
    return "";
  };
  auto const expect_parts = [](std::string const& message, std::vector<char const*> const& parts) {
    EXPECT_FALSE(message.empty()) << "accepted";
    for (char const* part : parts) EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;
  };
  EpConfig normal;
  EpConfig ll;
  ll.mode = Mode::low_latency;
  EpConfig masked = ll;
  masked.rank_masking = true;
  for (EpConfig const& config : {normal, ll, masked}) {
    EXPECT_EQ(refusal(config, Topology{1, 32}), "");
    EXPECT_EQ(refusal(config, Topology{4, 8}), "");
    EXPECT_EQ(refusal(config, Topology{32, 1}), "");
  }
  for (Topology const topology :
       {Topology{2, 17}, Topology{8, 8}, Topology{3, 12}, Topology{32, 8}, Topology{128, 8}, Topology{1024, 1}}) {
    EXPECT_EQ(refusal(ll, topology), "") << topology_name(topology);
    expect_parts(refusal(masked, topology), {"rank_masking with world=", "backend cuda", "up to 32 ranks", "1024"});
  }
  expect_parts(refusal(normal, Topology{5, 8}),
               {"world=40", "topology 5x8", "backend cuda", "mode=normal", "32 ranks", "mode=ll across nodes", "1024"});
  expect_parts(refusal(ll, Topology{1, 33}), {"world=33", "mode=ll on one node", "32 ranks", "1024"});
  expect_parts(refusal(masked, Topology{1, 40}), {"world=40", "mode=ll on one node", "32 ranks", "1024"});
}

TEST(Config, LowLatencyRules) {
  EpConfig config;
  config.mode = Mode::low_latency;
  config.max_tokens_per_rank = 128;
  EXPECT_EQ(config_error(config, 2), "");
  config.max_tokens_per_rank = kMaxLowLatencyTokens;
  EXPECT_EQ(config_error(config, 8), "");
  config.max_tokens_per_rank = kMaxLowLatencyTokens + 1;
  expect_message(config, 2, {"max_tokens_per_rank=1025", "mode=ll", "1024", "mode=normal"});
  config.max_tokens_per_rank = 128;
  config.max_recv_tokens = 100;
  expect_message(config, 2, {"max_recv_tokens=100", "mode=ll", "unset"});
  // the default capacity of ll is the worst case; an explicit one is kept; normal mode is left alone
  config.max_recv_tokens.reset();
  EXPECT_EQ(config.resolved(4).expert_slots(), 4 * 128);
  config.expert_capacity = 17;
  EXPECT_EQ(config.resolved(4).expert_slots(), 17);
  EpConfig normal;
  normal.max_tokens_per_rank = 8192;
  EXPECT_EQ(config_error(normal, 2), "");
  EXPECT_EQ(normal.resolved(2).expert_slots(), 0);
  EXPECT_EQ(parse_mode("ll"), Mode::low_latency);
  EXPECT_STREQ(mode_name(Mode::low_latency), "ll");
}

TEST(Config, QuantizedFormatsNeedWholeScaleBlocks) {
  EpConfig config;
  for (WireFormat format : {WireFormat::fp8_e4m3, WireFormat::fp8_e4m3_ue8m0, WireFormat::nvfp4, WireFormat::mxfp4}) {
    config.dispatch_format = format;
    config.combine_format = format;
    EXPECT_NO_THROW(config.validate(2)) << wire_format_name(format);  // hidden 7168: whole blocks of 16, 32 and 128
  }
  config.dispatch_format = WireFormat::fp8_e4m3;
  config.combine_format = WireFormat::bf16;
  config.hidden = 2880;  // gpt-oss-120b: 22.5 blocks of 128
  expect_message(config, 2, {"hidden=2880", "multiple of 128", "fp8", "use hidden=2944"});
  config.dispatch_format = WireFormat::mxfp4;  // 90 blocks of 32
  EXPECT_NO_THROW(config.validate(2));
}

TEST(WireFormat, RowBytes) {
  EXPECT_EQ(wire_row_bytes(WireFormat::bf16, 7168), 14336u);
  EXPECT_EQ(wire_row_bytes(WireFormat::fp8_e4m3, 7168), 7168u + 56u * 4u);
  EXPECT_EQ(wire_row_bytes(WireFormat::fp8_e4m3_ue8m0, 7168), 7168u + 64u);  // 56 scale bytes, padded to 16
  EXPECT_EQ(wire_row_bytes(WireFormat::nvfp4, 7168), 3584u + 448u + 16u);    // token scale padded to 16
  EXPECT_EQ(wire_row_bytes(WireFormat::mxfp4, 7168), 3584u + 224u);
  for (char const* name : {"bf16", "fp8", "fp8_ue8m0", "nvfp4", "mxfp4"})
    EXPECT_STREQ(wire_format_name(parse_wire_format(name)), name);
  EXPECT_THROW(parse_wire_format("fp16"), ConfigError);
}

TEST(Env, TableIsUniqueAndDocumented) {
  std::set<std::string> names;
  for (EnvParam const& param : env_params()) {
    EXPECT_TRUE(names.insert(param.name).second) << "duplicate " << param.name;
    EXPECT_GT(std::string(param.meaning).size(), 10u) << param.name;
  }
  EXPECT_TRUE(names.count("FERRY_TIMEOUT_S"));
}

TEST(Env, ParsesAndRejects) {
  ::unsetenv("FERRY_TIMEOUT_S");
  EXPECT_EQ(env_double("FERRY_TIMEOUT_S"), 30.0);
  ::setenv("FERRY_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(env_double("FERRY_TIMEOUT_S"), 2.5);
  ::setenv("FERRY_TIMEOUT_S", "soon", 1);
  try {
    env_double("FERRY_TIMEOUT_S");
    ADD_FAILURE() << "expected ConfigError";
  } catch (ConfigError const& error) {
    EXPECT_NE(std::string(error.what()).find("FERRY_TIMEOUT_S=soon"), std::string::npos) << error.what();
  }
  ::unsetenv("FERRY_TIMEOUT_S");
  EXPECT_FALSE(env_optional_int("FERRY_DISPATCH_BLOCKS").has_value());
  EXPECT_THROW(env_string("FERRY_NOT_DECLARED"), ConfigError);
}

TEST(Error, FormatNamesSubsystemFileAndLine) {
  try {
    FERRY_CHECK_INPUT(1 + 1 == 3, "x=", 3, " is wrong; use 2");
    ADD_FAILURE() << "FERRY_CHECK_INPUT did not throw";
  } catch (InputError const& error) {
    std::string const message = error.what();
    EXPECT_EQ(message.rfind("input error (test_config.cpp:", 0), 0u) << message;
    EXPECT_NE(message.find("): x=3 is wrong; use 2"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// The README's environment table must list every declared parameter (one table, no drift).
TEST(Env, ReadmeListsEveryParameter) {
  std::ifstream readme(FERRY_SOURCE_DIR "/README.md");
  ASSERT_TRUE(readme.good()) << "README.md not found under " << FERRY_SOURCE_DIR;
  std::string const text((std::istreambuf_iterator<char>(readme)), std::istreambuf_iterator<char>());
  for (EnvParam const& param : env_params())
    EXPECT_NE(text.find(std::string("`") + param.name + "`"), std::string::npos)
        << param.name << " missing from README";
}

}  // namespace
}  // namespace ferry
