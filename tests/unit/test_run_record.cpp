// The host side of the cuda backend's "what ran" record (src/ep/run_record.hpp): the protocol choice and its fallback
// rule (detail::choose_protocol), the test-only switch that forces the fallback, and explain()'s text built from a
// record (a fallback is named, never "fast path"). The GPU walk of the supported grid is
// tests/gpu/test_fast_path_virtual.cu.
#include <gtest/gtest.h>

#include <string>

#include "ep/landing_policy.hpp"
#include "ep/run_record.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::detail {
namespace {

using test::contains;

EpConfig small(int max_tokens, WireFormat format = WireFormat::bf16) {
  EpConfig config;
  config.hidden = 7168;
  config.topk = 8;
  config.num_experts = 64;
  config.max_tokens_per_rank = max_tokens;
  config.dispatch_format = format;
  return config;
}

// Rank masking across nodes on cuda runs the direct route: automatic resolves to it, an explicit forward route is
// refused with the reason, and nothing changes without masking, on one node, or in normal mode.
TEST(RunRecord, RankMaskingAcrossNodesTakesTheDirectRouteOnCuda) {
  EpConfig ll = small(128);
  ll.mode = Mode::low_latency;
  ll.rank_masking = true;
  Topology const two{2, 4};
  ASSERT_EQ(ll.route(), InternodeRoute::forward) << "128 tokens take the forward route unmasked";
  EXPECT_EQ(cuda_route_for_masking(ll, two).route(), InternodeRoute::direct);
  EXPECT_EQ(cuda_route_for_masking(ll, Topology{1, 8}).route(), InternodeRoute::forward) << "one node: unchanged";
  EpConfig unmasked = ll;
  unmasked.rank_masking = false;
  EXPECT_EQ(cuda_route_for_masking(unmasked, two).route(), InternodeRoute::forward);
  EpConfig direct = ll;
  direct.internode_route = InternodeRoute::direct;
  EXPECT_EQ(cuda_route_for_masking(direct, two).route(), InternodeRoute::direct);
  EpConfig forward = ll;
  forward.internode_route = InternodeRoute::forward;
  try {
    cuda_route_for_masking(forward, two);
    ADD_FAILURE() << "an explicit forward route with rank masking across nodes was accepted";
  } catch (ConfigError const& error) {
    EXPECT_TRUE(contains(error.what(), "internode_route=forward")) << error.what();
    EXPECT_TRUE(contains(error.what(), "2x4")) << error.what();
    EXPECT_TRUE(contains(error.what(), "use internode_route=direct or automatic")) << error.what();
  }
}

TEST(RunRecord, ProtocolFallbackIsASmallBatchOnTheCountExchange) {
  // the fast protocol of each size: no fallback
  ProtocolChoice const landing = choose_protocol(small(16), 2, "auto");
  EXPECT_EQ(landing.protocol, Protocol::landing);
  EXPECT_FALSE(landing.fallback) << landing.why;
  ProtocolChoice const large = choose_protocol(small(4096), 2, "auto");
  EXPECT_EQ(large.protocol, Protocol::push);
  EXPECT_FALSE(large.fallback) << large.why;
  EXPECT_FALSE(choose_protocol(small(16, WireFormat::fp8_e4m3), 2, "off").fallback);  // the user's pin
  EpConfig ll = small(16);
  ll.mode = Mode::low_latency;
  EXPECT_EQ(choose_protocol(ll, 2, "auto").protocol, Protocol::ll);
  EXPECT_FALSE(choose_protocol(ll, 2, "auto").fallback);
  // a small quantized batch lands too: no fallback
  ProtocolChoice const quantized = choose_protocol(small(16, WireFormat::fp8_e4m3), 2, "auto");
  EXPECT_EQ(quantized.protocol, Protocol::landing);
  EXPECT_FALSE(quantized.fallback) << quantized.why;
  // a small batch the landing zone cannot serve (a receiver may drop rows): the slower protocol for its size
  EpConfig capped = small(128);
  capped.max_recv_tokens = 200;
  ProtocolChoice const dropping = choose_protocol(capped, 2, "auto");
  EXPECT_EQ(dropping.protocol, Protocol::push);
  EXPECT_TRUE(dropping.fallback) << dropping.why;
  EXPECT_TRUE(contains(dropping.why, "max_recv_tokens=200")) << dropping.why;
  // ... but a large quantized batch takes the count exchange anyway: no fallback
  EXPECT_FALSE(choose_protocol(small(4096, WireFormat::fp8_e4m3), 2, "auto").fallback);
}

TEST(RunRecord, ForcedFallbackTakesTheSlowerBranchUntilCleared) {
  force_fallback_for_test(true);
  ProtocolChoice const forced = choose_protocol(small(16), 2, "auto");
  force_fallback_for_test(false);
  EXPECT_EQ(forced.protocol, Protocol::push);
  EXPECT_TRUE(forced.fallback);
  EXPECT_TRUE(contains(forced.why, "forced")) << forced.why;
  EXPECT_FALSE(fallback_forced_for_test());
  EXPECT_FALSE(choose_protocol(small(16), 2, "auto").fallback);
}

ExplainContext context_of(EpConfig const& config, char const* why) {
  ExplainContext context;
  context.config = &config;
  context.protocol_why = why;
  context.warps = 16;
  context.ll_chunk_elems = 1024;
  return context;
}

TEST(RunRecord, ExplainIsBuiltFromTheRecord) {
  EpConfig const config = small(16);
  ExplainContext const context = context_of(config, "landing zone (small)");
  RunRecord record;
  EXPECT_EQ(explain_text(record, context), "dispatch: not run\ncombine: not run");

  record.dispatch.ran = true;
  record.dispatch.protocol = Protocol::landing;
  record.dispatch.ctas = 132;
  record.dispatch.ids = IndexType::int64;
  record.dispatch.plan_why = "one CTA per SM";
  record.combine.ran = true;
  record.combine.protocol = Protocol::landing;
  record.combine.ctas = 132;
  record.combine.push_ctas = 88;
  record.combine.plan_why = "grid = SMs";
  std::string const fast = explain_text(record, context);
  EXPECT_TRUE(contains(fast, "dispatch: normal/nvlink-landing")) << fast;
  EXPECT_TRUE(contains(fast, "landing zone (small)")) << fast;
  EXPECT_TRUE(contains(fast, "132 CTAs x 16 warps (one CTA per SM), ids int64")) << fast;
  EXPECT_TRUE(contains(fast, "88 push + 44 sum CTAs")) << fast;
  EXPECT_TRUE(contains(fast, "; fast path")) << fast;
  EXPECT_FALSE(contains(fast, "fallback")) << fast;

  // a fallback is named, and the leg no longer claims the fast path
  record.dispatch.protocol = Protocol::push;
  record.dispatch.fallbacks = kFallbackCountExchange | kFallbackGridClamped;
  std::string const slow = explain_text(record, context_of(config, "count exchange (max_recv_tokens=200 ...)"));
  std::string const dispatch_line = slow.substr(0, slow.find('\n'));
  EXPECT_FALSE(contains(dispatch_line, "fast path")) << slow;
  EXPECT_TRUE(contains(dispatch_line, "fallback: a small batch took the count exchange")) << slow;
  EXPECT_TRUE(contains(dispatch_line, "fewer CTAs")) << slow;

  // refusals say which exchange they joined
  record.dispatch.refused = true;
  record.dispatch.protocol = Protocol::landing;
  EXPECT_TRUE(contains(explain_text(record, context), "joined the landing zone")) << explain_text(record, context);
}

TEST(RunRecord, ExplainNamesTheFormatsAndUnits) {
  EpConfig config = small(16, WireFormat::nvfp4);
  config.combine_format = WireFormat::nvfp4;
  config.mode = Mode::low_latency;
  ExplainContext const context = context_of(config, "");
  RunRecord record;
  record.dispatch.ran = record.combine.ran = true;
  record.dispatch.protocol = record.combine.protocol = Protocol::ll;
  record.dispatch.plan_why = record.combine.plan_why = "one CTA per SM";
  record.dispatch.fallbacks = kFallbackNarrowUnits;
  std::string const text = explain_text(record, context);
  EXPECT_TRUE(contains(text, "dispatch: ll/nvlink-push one kernel")) << text;
  EXPECT_TRUE(contains(text, "wire nvfp4 (quantized once per token in the send loop")) << text;
  EXPECT_TRUE(contains(text, "fallback: 16-element nvfp4 units")) << text;
  EXPECT_TRUE(contains(text, "warp per (row, 1024-element chunk)")) << text;
  EXPECT_TRUE(contains(text, "meet the row's amax, its token scale, in shared memory")) << text;
  EXPECT_TRUE(fallback_text(kNoFallback, "").empty());
}

// Across nodes a low-latency leg names its route and network (docs/internode.md: "explain() names the route"); on
// one node it is the NVLink push alone.
TEST(RunRecord, ExplainNamesTheLowLatencyRouteAcrossNodes) {
  EpConfig config = small(128);
  config.mode = Mode::low_latency;
  RunRecord record;
  record.dispatch.ran = record.combine.ran = true;
  record.dispatch.protocol = record.combine.protocol = Protocol::ll;
  record.dispatch.plan_why = record.combine.plan_why = "one CTA per SM";
  char const* const forward = "low-latency, rows forwarded once per node by its rail (2x1, network: emulated)";
  std::string const across = explain_text(record, context_of(config, forward));
  EXPECT_TRUE(contains(across, concat("dispatch: ll/", forward, "; own node: nvlink-push one kernel"))) << across;
  EXPECT_TRUE(contains(across, concat("combine: ll/", forward, "; own node: nvlink-push one kernel"))) << across;
  std::string const one_node = explain_text(record, context_of(config, ""));
  EXPECT_TRUE(contains(one_node, "dispatch: ll/nvlink-push one kernel")) << one_node;
  EXPECT_FALSE(contains(one_node, "own node")) << one_node;
}

}  // namespace
}  // namespace ferry::detail
