// What the cuda backend's last call of each leg ran, recorded as a small POD on the hot path (no string, no
// allocation) and turned into explain()'s text only when explain() is asked (explain_text). Host code, so CI tests
// the text and the fallback rules; the backend (src/ep/cuda/cuda_ep.cu) and the launchers fill the record.
#pragma once

#include <cstdint>
#include <string>

#include "ep/landing_policy.hpp"
#include "ferry/ep.hpp"

namespace ferry::detail {

// What can make a leg run a slower variant than its fast path (DESIGN "No silent slow paths"), as bits.
enum Fallback : uint8_t {
  kNoFallback = 0,
  // normal dispatch: a batch small enough for the landing zone took the count exchange (choose_normal_landing's
  // rules: a quantized dispatch_format, a max_recv_tokens cap, the receiver's shared memory; or a forced test).
  kFallbackCountExchange = 1 << 0,
  // an nvfp4 leg ran 16-element codec units (8-byte payload pieces) where hidden % 32 != 0 rules out 32.
  kFallbackNarrowUnits = 1 << 1,
  // the grid ran fewer CTAs than its plan asked for (a pin or table row past one CTA per SM, ranks with fewer SMs
  // in low-latency mode, or a forced test).
  kFallbackGridClamped = 1 << 2,
};

// One leg's last call. plan_why points to text the backend owns for its lifetime (a plan's reason, fixed per
// EpBuffer and token count), never to a temporary.
struct LegRecord {
  bool ran = false;
  bool refused = false;  // refuse_dispatch / refuse_combine: joined with the abort flag
  bool split = false;    // low-latency send half now, receive half in complete_* (return_recv_hook)
  bool prequantized = false;
  bool expand = false;        // dispatch: then the expert-major layout
  bool expert_major = false;  // combine: layout=expert_major
  Protocol protocol = Protocol::push;
  IndexType ids = IndexType::int32;
  int ctas = 0;
  int push_ctas = 0;  // normal combine
  int unit = 0;       // codec unit elements of the instance that ran (0: bf16 rows copied)
  uint8_t fallbacks = kNoFallback;
  char const* plan_why = "";
};

struct RunRecord {
  LegRecord dispatch;
  LegRecord combine;
};

// What explain() needs besides the record, fixed per EpBuffer.
struct ExplainContext {
  EpConfig const* config = nullptr;
  // normal mode: choose_normal_landing's reason (across nodes: the hierarchical protocol and its network);
  // low-latency mode: "" on one node, across nodes the route and the network
  char const* protocol_why = "";
  int warps = 0;            // warps per CTA of every kernel
  int ll_chunk_elems = 0;   // elements of a low-latency combine work item
  bool own_direct = false;  // FERRY_LL_OWN_ROWS=direct
  bool cooperative = true;
};

// explain()'s text: one line per leg ("dispatch: not run" before the first call).
std::string explain_text(RunRecord const& record, ExplainContext const& context);

// The fallbacks of a record, named (empty for none): what explain() appends after "fallback: ".
std::string fallback_text(uint8_t fallbacks, char const* protocol_why);

// TEST ONLY. While set, the fallback decisions take their slower branch: a normal-mode EpBuffer created then takes
// the count exchange where the landing zone would serve (kFallbackCountExchange), and a low-latency grid runs half its
// CTAs (kFallbackGridClamped), so a test can show its fast-path check fails. Process-wide; never set in production.
void force_fallback_for_test(bool on);
bool fallback_forced_for_test();

// TEST ONLY: the record of a cuda EpBuffer's last calls (null for a backend that keeps none, e.g. cpu).
RunRecord const* run_record_of(EpBuffer const& buffer);

}  // namespace ferry::detail
