// The choice between normal mode's two dispatch protocols (src/ep/landing_policy.hpp), made once per EpBuffer on the
// host: the landing zone for small batches (every wire format) whose rows no receiver can drop, the count exchange
// otherwise, and FERRY_NORMAL_LANDING's pins with a clear error for a pin the config cannot honour.
#include <gtest/gtest.h>

#include <string>

#include "ep/landing_policy.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::detail {
namespace {

using test::contains;

EpConfig small_config(int max_tokens) {
  EpConfig config;
  config.hidden = 7168;
  config.topk = 8;
  config.num_experts = 256;
  config.max_tokens_per_rank = max_tokens;
  return config;
}

// The ConfigError message of choose_normal_landing, or "" when it did not throw.
std::string config_error(EpConfig const& config, int world, std::string const& pin) {
  try {
    choose_normal_landing(config, world, pin);
  } catch (ConfigError const& error) {
    return error.what();
  }
  return {};
}

TEST(LandingPolicy, AutoTakesTheLandingZoneUpToTheSlotBound) {
  // world * max_tokens_per_rank <= kLandingAutoMaxSlots: 512 tokens per rank at EP2, 128 at EP8
  for (int world : {2, 8}) {
    int const most = kLandingAutoMaxSlots / world;
    for (std::string const pin : {"", "auto"}) {
      LandingChoice const small = choose_normal_landing(small_config(most), world, pin);
      EXPECT_TRUE(small.use) << small.why;
      EXPECT_TRUE(contains(small.why, "landing zone")) << small.why;
      LandingChoice const one = choose_normal_landing(small_config(1), world, pin);
      EXPECT_TRUE(one.use) << one.why;
      LandingChoice const large = choose_normal_landing(small_config(most + 1), world, pin);
      EXPECT_FALSE(large.use) << large.why;
      EXPECT_TRUE(contains(large.why, "world * max_tokens_per_rank=" + std::to_string(world * (most + 1))))
          << large.why;
    }
  }
  EXPECT_TRUE(choose_normal_landing(small_config(512), 2, "auto").use);
  EXPECT_FALSE(choose_normal_landing(small_config(1024), 2, "auto").use);
}

// Every wire format lands: a quantized row travels as its wire row, delivered quantized or dequantized.
TEST(LandingPolicy, AutoTakesTheLandingZoneForEveryDispatchFormat) {
  for (WireFormat const format :
       {WireFormat::bf16, WireFormat::fp8_e4m3, WireFormat::fp8_e4m3_ue8m0, WireFormat::nvfp4, WireFormat::mxfp4}) {
    for (bool const dequantize : {false, true}) {
      EpConfig config = small_config(128);
      config.dispatch_format = format;
      config.dispatch_dequantize = dequantize && format != WireFormat::bf16;
      LandingChoice const choice = choose_normal_landing(config, 2, "auto");
      EXPECT_TRUE(choice.use) << wire_format_name(format) << ": " << choice.why;
      EXPECT_FALSE(choice.fallback) << wire_format_name(format);
      EXPECT_TRUE(choose_normal_landing(config, 2, "on").use) << wire_format_name(format);
      EXPECT_FALSE(choose_normal_landing(config, 2, "off").use) << wire_format_name(format);
    }
  }
}

TEST(LandingPolicy, AutoKeepsTheCountExchangeWhereTheLandingZoneCannotServe) {
  EpConfig capped = small_config(128);
  capped.max_recv_tokens = 200;  // below 2 * 128: a receiver may drop rows the senders cannot know about
  LandingChoice const c = choose_normal_landing(capped, 2, "auto");
  EXPECT_FALSE(c.use);
  EXPECT_TRUE(contains(c.why, "max_recv_tokens=200")) << c.why;
  capped.max_recv_tokens = 256;  // a cap at the worst case drops nothing
  EXPECT_TRUE(choose_normal_landing(capped, 2, "auto").use);

  EpConfig ll = small_config(128);
  ll.mode = Mode::low_latency;
  EXPECT_FALSE(choose_normal_landing(ll, 2, "auto").use);

  // an expert capacity below the receive capacity can drop entries that only their receiver would find: the count
  // exchange carries every expert's counts to every rank instead (a drop is an error on every rank)
  EpConfig slots = small_config(128);
  slots.expert_capacity = 255;
  LandingChoice const s = choose_normal_landing(slots, 2, "auto");
  EXPECT_FALSE(s.use);
  EXPECT_TRUE(s.fallback);
  EXPECT_TRUE(contains(s.why, "expert_capacity=255 is below the receive capacity 256")) << s.why;
  std::string const pinned = config_error(slots, 2, "on");
  EXPECT_TRUE(contains(pinned, "FERRY_NORMAL_LANDING=on")) << pinned;
  EXPECT_TRUE(contains(pinned, "expert_capacity=255")) << pinned;
  slots.expert_capacity = 256;  // every entry has a slot
  EXPECT_TRUE(choose_normal_landing(slots, 2, "auto").use);
}

TEST(LandingPolicy, PinsOverrideTheBoundAndRefuseWhatCannotWork) {
  LandingChoice const on = choose_normal_landing(small_config(4096), 2, "on");
  EXPECT_TRUE(on.use);
  EXPECT_TRUE(contains(on.why, "FERRY_NORMAL_LANDING=on")) << on.why;
  EXPECT_TRUE(choose_normal_landing(small_config(512), 2, "1").use);
  EXPECT_FALSE(choose_normal_landing(small_config(1), 2, "off").use);
  EXPECT_FALSE(choose_normal_landing(small_config(1), 2, "0").use);

  EpConfig capped = small_config(16);
  capped.max_recv_tokens = 20;  // below 2 * 16: a receiver may drop rows
  std::string const refused = config_error(capped, 2, "on");
  EXPECT_TRUE(contains(refused, "FERRY_NORMAL_LANDING=on")) << refused;
  EXPECT_TRUE(contains(refused, "max_recv_tokens=20")) << refused;

  // the receiver's shared memory: one int per landing slot of every source, plus one per local expert
  EpConfig huge = small_config(8192);
  EXPECT_GT(landing_smem_bytes(huge, 8), kLandingMaxSmem);
  std::string const smem = config_error(huge, 8, "on");
  EXPECT_TRUE(contains(smem, "shared memory")) << smem;
  EXPECT_EQ(landing_smem_bytes(small_config(256), 2), (2u * 256 + 128) * 4);

  std::string const bad = config_error(small_config(16), 2, "yes");
  EXPECT_TRUE(contains(bad, "FERRY_NORMAL_LANDING=yes is not one of auto, on, off")) << bad;
}

}  // namespace
}  // namespace ferry::detail
