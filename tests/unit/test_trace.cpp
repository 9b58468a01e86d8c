// In-kernel tracing, host side: the slot table, the event format, the decoder (spans, orphans, dropped events,
// alignment of ranks), the per-phase table, the Chrome JSON (parsed back in process) and the trace files. The
// buffers are synthetic; the GPU test (tests/gpu/test_trace.cpp) checks what the kernels record.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/trace.hpp"
#include "support/host_fixtures.hpp"
#include "trace/decode.hpp"
#include "trace/synthetic.hpp"
#include "trace/trace_file.hpp"
#include "trace/trace_format.hpp"
#include "core/util/json.hpp"

namespace ferry::trace {
namespace {

namespace json = util::json;

constexpr auto kBegin = TraceEventKind::begin;
constexpr auto kEnd = TraceEventKind::end;
constexpr auto kInstant = TraceEventKind::instant;

// A hand-written buffer: events[w] are warp w's events in order; counts default to the number of events.
TraceBuffer make_buffer(
    int rank, TraceKernel kernel, int warps_per_cta, int capacity,
    std::vector<std::vector<std::tuple<int64_t, TraceSlot, TraceEventKind, uint32_t>>> const& warps) {
  TraceBuffer b;
  b.rank = rank;
  b.kernel = kernel;
  b.warps_per_cta = warps_per_cta;
  b.ctas = static_cast<int>(warps.size()) / warps_per_cta;
  b.capacity = capacity;
  b.counts.assign(warps.size(), 0);
  b.events.assign(warps.size() * capacity, TraceEvent{0, 0});
  for (std::size_t w = 0; w < warps.size(); ++w) {
    b.counts[w] = static_cast<uint32_t>(warps[w].size());
    for (std::size_t i = 0; i < warps[w].size() && i < static_cast<std::size_t>(capacity); ++i) {
      auto const& [time, slot, kind, payload] = warps[w][i];
      b.events[w * capacity + i] =
          TraceEvent{static_cast<uint64_t>(time), event_meta(static_cast<uint32_t>(slot), static_cast<uint32_t>(kind),
                                                             static_cast<uint32_t>(w / warps_per_cta),
                                                             static_cast<uint32_t>(w % warps_per_cta), payload)};
    }
  }
  return b;
}

TEST(TraceSlots, EveryNameUniqueAndPrefixedByItsKernel) {
  std::set<std::string> names;
  std::set<int> kernels;
  for (int s = 0; s < kNumSlots; ++s) {
    std::string const name = kSlotNames[s];
    ASSERT_FALSE(name.empty()) << "slot " << s;
    EXPECT_TRUE(names.insert(name).second) << "slot name " << name << " is declared twice";
    std::string const prefix = std::string(trace_kernel_name(kSlotKernel[s])) + ".";
    EXPECT_EQ(name.rfind(prefix, 0), 0u) << name << " does not start with its kernel " << prefix;
    EXPECT_GT(name.size(), prefix.size()) << name;
    kernels.insert(static_cast<int>(kSlotKernel[s]));
  }
  EXPECT_EQ(static_cast<int>(kernels.size()), kNumTraceKernels) << "a kernel family without slots";
  EXPECT_EQ(slot_names().size(), static_cast<std::size_t>(kNumSlots));
  EXPECT_STREQ(kSlotNames[static_cast<int>(TraceSlot::dispatch_layout)], "dispatch.layout");
  EXPECT_STREQ(kSlotNames[static_cast<int>(TraceSlot::combine_sum)], "combine.sum");
  for (int k = 0; k < kNumTraceKernels; ++k)
    EXPECT_EQ(parse_trace_kernel(trace_kernel_name(static_cast<TraceKernel>(k))), static_cast<TraceKernel>(k));
  EXPECT_THROW(parse_trace_kernel("expand"), ConfigError);
}

TEST(TraceFormat, MetaRoundTripsEveryField) {
  uint64_t const meta = event_meta(kNumSlots - 1, 2, 65535, 63, 0xdeadbeefu);
  EXPECT_EQ(meta_slot(meta), static_cast<uint32_t>(kNumSlots - 1));
  EXPECT_EQ(meta_kind(meta), 2u);
  EXPECT_EQ(meta_cta(meta), 65535u);
  EXPECT_EQ(meta_warp(meta), 63u);
  EXPECT_EQ(meta_payload(meta), 0xdeadbeefu);
  uint64_t const zero = event_meta(0, 0, 0, 0, 0);
  EXPECT_EQ(zero, 0u);
  EXPECT_EQ(sizeof(TraceEvent), 16u);
#if !FERRY_TRACE
  EXPECT_TRUE(std::is_empty_v<TraceView>) << "with FERRY_TRACE off the kernels' TraceView must be empty";
#endif
}

TEST(TraceDecode, NestedSpansAndInstants) {
  using S = TraceSlot;
  TraceBuffer const b = make_buffer(0, TraceKernel::dispatch, 2, 8,
                                    {{{1000, S::dispatch_layout, kBegin, 0},
                                      {1100, S::dispatch_grid_arrival, kBegin, 0},
                                      {1300, S::dispatch_grid_arrival, kEnd, 0},
                                      {1500, S::dispatch_layout, kEnd, 0},
                                      {1600, S::dispatch_push, kInstant, 42}},
                                     {{1200, S::dispatch_push, kBegin, 0}, {2200, S::dispatch_push, kEnd, 0}}});
  Decoded const d = decode(std::span(&b, 1));
  ASSERT_EQ(d.spans.size(), 3u);
  EXPECT_EQ(d.events, 7);
  EXPECT_EQ(d.orphan_begins + d.orphan_ends + d.dropped + d.bad_events, 0);
  // spans come out at their end: the inner one first
  EXPECT_EQ(d.spans[0].slot, static_cast<uint8_t>(S::dispatch_grid_arrival));
  EXPECT_EQ(d.spans[0].depth, 1);
  EXPECT_EQ(d.spans[0].begin_ns, 100);  // aligned on the rank's first event (1000)
  EXPECT_EQ(d.spans[0].end_ns, 300);
  EXPECT_EQ(d.spans[1].slot, static_cast<uint8_t>(S::dispatch_layout));
  EXPECT_EQ(d.spans[1].depth, 0);
  EXPECT_EQ(d.spans[1].end_ns - d.spans[1].begin_ns, 500);
  EXPECT_EQ(d.spans[2].tid, 1u);
  ASSERT_EQ(d.instants.size(), 1u);
  EXPECT_EQ(d.instants[0].value, 42u);
  EXPECT_EQ(d.instants[0].time_ns, 600);
  ASSERT_EQ(d.buffers.size(), 1u);
  EXPECT_EQ(d.buffers[0].first_ns, 0);
  EXPECT_EQ(d.buffers[0].last_ns, 1200);
}

TEST(TraceDecode, OrphansAreDroppedAndCounted) {
  using S = TraceSlot;
  TraceBuffer const b = make_buffer(3, TraceKernel::dispatch, 1, 16,
                                    {{{10, S::dispatch_layout, kEnd, 0},        // end without a begin
                                      {20, S::dispatch_push, kBegin, 0},        //
                                      {30, S::dispatch_signal, kBegin, 0},      // never ended: closed by push's end
                                      {40, S::dispatch_push, kEnd, 0},          // span push [20, 40]
                                      {50, S::dispatch_wait_data, kEnd, 0},     // end without a begin
                                      {60, S::dispatch_outputs, kBegin, 0}}});  // begin at the end of the warp
  Decoded const d = decode(std::span(&b, 1));
  ASSERT_EQ(d.spans.size(), 1u);
  EXPECT_EQ(d.spans[0].slot, static_cast<uint8_t>(S::dispatch_push));
  EXPECT_EQ(d.spans[0].rank, 3);
  EXPECT_EQ(d.spans[0].end_ns - d.spans[0].begin_ns, 20);
  EXPECT_EQ(d.orphan_ends, 2);
  EXPECT_EQ(d.orphan_begins, 2);
  EXPECT_EQ(d.bad_events, 0);
}

TEST(TraceDecode, EventsPastTheCapacityAreCountedAsDropped) {
  using S = TraceSlot;
  TraceBuffer b = make_buffer(0, TraceKernel::combine, 1, 4,
                              {{{0, S::combine_push, kBegin, 0},
                                {5, S::combine_push, kEnd, 0},
                                {6, S::combine_push, kBegin, 0},
                                {9, S::combine_push, kEnd, 0},
                                {10, S::combine_push, kBegin, 0},  // past the capacity: never written
                                {12, S::combine_push, kEnd, 0}}});
  EXPECT_EQ(b.counts[0], 6u);
  Decoded const d = decode(std::span(&b, 1));
  EXPECT_EQ(d.dropped, 2);
  EXPECT_EQ(d.events, 4);
  EXPECT_EQ(d.spans.size(), 2u);
  // a warp that overflowed in the middle of a span leaves its begin orphaned
  b.capacity = 3;
  b.events.resize(3);
  Decoded const cut = decode(std::span(&b, 1));
  EXPECT_EQ(cut.dropped, 3);
  EXPECT_EQ(cut.spans.size(), 1u);
  EXPECT_EQ(cut.orphan_begins, 1);
}

TEST(TraceDecode, BadEventsAreCountedNotDecoded) {
  using S = TraceSlot;
  TraceBuffer b = make_buffer(0, TraceKernel::dispatch, 2, 4,
                              {{{0, S::dispatch_layout, kBegin, 0}, {5, S::combine_sum, kBegin, 0}},  // wrong kernel
                               {{1, S::dispatch_layout, kBegin, 0}, {2, S::dispatch_layout, kEnd, 0}}});
  b.events[4].meta = event_meta(static_cast<uint32_t>(S::dispatch_layout), 0, 0, 0, 0);  // warp 1 claiming warp 0
  b.events[5].meta = event_meta(kNumSlots, 1, 0, 1, 0);                                  // unknown slot
  b.counts[1] = 2;
  Decoded const d = decode(std::span(&b, 1));
  EXPECT_EQ(d.bad_events, 3);
  EXPECT_EQ(d.spans.size(), 0u);
  EXPECT_EQ(d.orphan_begins, 1);
}

TEST(TraceDecode, GeometryMismatchIsRefused) {
  TraceBuffer b = synthetic_trace(0, TraceKernel::dispatch, 2, 4, 8, 0);
  b.events.pop_back();
  EXPECT_THROW(decode(std::span(&b, 1)), InputError);
  b = synthetic_trace(0, TraceKernel::dispatch, 2, 4, 8, 0);
  b.counts.push_back(0);
  EXPECT_THROW(decode(std::span(&b, 1)), InputError);
}

// Two ranks whose GPU clocks differ by a large offset, each with a dispatch and a combine.
std::vector<TraceBuffer> two_ranks() {
  using S = TraceSlot;
  std::vector<TraceBuffer> out;
  for (int rank = 0; rank < 2; ++rank) {
    int64_t const base = rank == 0 ? 5'000'000 : 900'000'000;
    int64_t const late = rank == 0 ? 0 : 40;  // rank 1 arrives later at the count exchange
    out.push_back(make_buffer(rank, TraceKernel::dispatch, 1, 8,
                              {{{base, S::dispatch_layout, kBegin, 0},
                                {base + 100, S::dispatch_layout, kEnd, 0},
                                {base + 100, S::dispatch_wait_counts, kBegin, 0},
                                {base + 200 + late, S::dispatch_wait_counts, kEnd, 0},
                                {base + 200 + late, S::dispatch_push, kBegin, 0},
                                {base + 1000 + late, S::dispatch_push, kEnd, 0}}}));
    out.push_back(make_buffer(rank, TraceKernel::combine, 1, 4,
                              {{{base + 2000, S::combine_push, kBegin, 0},
                                {base + 2400 + late, S::combine_push, kEnd, 0},
                                {base + 2400 + late, S::combine_sum, kInstant, 7}}}));
  }
  return out;
}

TEST(TraceDecode, RanksAlignedOnFirstEventSlotOrRaw) {
  std::vector<TraceBuffer> const buffers = two_ranks();
  Decoded const first = decode(buffers);
  ASSERT_EQ(first.spans.size(), 8u);
  EXPECT_EQ(first.spans[0].begin_ns, 0);  // rank 0 layout
  EXPECT_EQ(first.spans[4].begin_ns, 0);  // rank 1 layout
  EXPECT_EQ(first.buffers[2].t0_ns, 900'000'000);
  EXPECT_EQ(first.buffers[3].first_ns, 2000);  // rank 1's combine on rank 1's dispatch clock

  DecodeOptions slot;
  slot.align = Align::slot_end;
  slot.align_slot = TraceSlot::dispatch_wait_counts;
  Decoded const by_slot = decode(buffers, slot);
  EXPECT_EQ(by_slot.unaligned_ranks, 0);
  EXPECT_EQ(by_slot.spans[1].end_ns, 0);  // rank 0's wait_counts end is its t = 0
  EXPECT_EQ(by_slot.spans[5].end_ns, 0);  // and rank 1's
  EXPECT_EQ(by_slot.spans[4].begin_ns, -240);

  slot.align_slot = TraceSlot::combine_wait_tile;  // no rank recorded it: first events instead, counted
  Decoded const missing = decode(buffers, slot);
  EXPECT_EQ(missing.unaligned_ranks, 2);
  EXPECT_EQ(missing.spans[4].begin_ns, 0);

  DecodeOptions raw;
  raw.align = Align::raw;
  Decoded const r = decode(buffers, raw);
  EXPECT_EQ(r.spans[0].begin_ns, 0);
  EXPECT_EQ(r.spans[4].begin_ns, 895'000'000);
  EXPECT_EQ(parse_align("slot"), Align::slot_end);
  EXPECT_THROW(parse_align("barrier"), ConfigError);
}

TEST(TracePhaseTable, MinMedianMaxAcrossRanks) {
  Decoded const d = decode(two_ranks());
  PhaseTable const table = phase_table(d);
  ASSERT_EQ(table.windows.size(), 2u);
  EXPECT_EQ(table.windows[0].kernel, TraceKernel::dispatch);
  EXPECT_DOUBLE_EQ(table.windows[0].window_us.min, 1.0);    // rank 0: 0 .. 1000 ns
  EXPECT_DOUBLE_EQ(table.windows[0].window_us.max, 1.040);  // rank 1: 0 .. 1040 ns
  EXPECT_DOUBLE_EQ(table.windows[0].window_us.median, 1.020);
  PhaseRow const* wait = nullptr;
  for (PhaseRow const& row : table.phases)
    if (row.slot == TraceSlot::dispatch_wait_counts) wait = &row;
  ASSERT_NE(wait, nullptr);
  EXPECT_EQ(wait->ranks, 2);
  EXPECT_EQ(wait->spans, 2);
  EXPECT_DOUBLE_EQ(wait->warp_us.min, 0.1);
  EXPECT_DOUBLE_EQ(wait->warp_us.max, 0.14);
  EXPECT_DOUBLE_EQ(wait->share.min, 0.1);
  EXPECT_NEAR(wait->share.max, 0.14 / 1.04, 1e-12);
  // on each rank's timeline: wait_counts starts 100 ns after the window's first event on both ranks and ends at
  // 200 ns (rank 0) and 240 ns (rank 1)
  EXPECT_DOUBLE_EQ(wait->begin_us.min, 0.1);
  EXPECT_DOUBLE_EQ(wait->begin_us.max, 0.1);
  EXPECT_DOUBLE_EQ(wait->end_us.min, 0.2);
  EXPECT_DOUBLE_EQ(wait->end_us.max, 0.24);
  EXPECT_DOUBLE_EQ(wait->end_us.median, 0.22);
  std::string const text = format_phase_table(table, d);
  EXPECT_NE(text.find("dispatch.wait_counts"), std::string::npos) << text;
  EXPECT_NE(text.find("   0.10..0.22\n"), std::string::npos) << "wait_counts' median begin..end\n" << text;
  EXPECT_NE(text.find("combine.push"), std::string::npos) << text;
  EXPECT_EQ(text.find("combine.wait_tile"), std::string::npos) << "a phase nobody recorded is not listed\n" << text;
}

TEST(TraceCtaTable, EachCtaOfOnePhaseOnEveryRank) {
  using S = TraceSlot;
  // combine on two ranks, 2 CTAs x 2 warps: CTA 0's warps push two items each (100 and 300 ns long), CTA 1's one
  // item of 500 ns that starts late; a sum span that the table must leave out
  std::vector<TraceBuffer> buffers;
  for (int rank = 0; rank < 2; ++rank) {
    int64_t const t0 = rank == 0 ? 1000 : 77'000;
    std::vector<std::tuple<int64_t, TraceSlot, TraceEventKind, uint32_t>> const cta0 = {
        {t0, S::combine_push, kBegin, 0},
        {t0 + 100, S::combine_push, kEnd, 0},
        {t0 + 100, S::combine_push, kBegin, 0},
        {t0 + 400, S::combine_push, kEnd, 0}};
    std::vector<std::tuple<int64_t, TraceSlot, TraceEventKind, uint32_t>> const cta1 = {
        {t0 + 50, S::combine_sum, kBegin, 0},
        {t0 + 60, S::combine_sum, kEnd, 0},
        {t0 + 1000, S::combine_push, kBegin, 0},
        {t0 + 1500 + rank, S::combine_push, kEnd, 0}};
    buffers.push_back(make_buffer(rank, TraceKernel::combine, 2, 8, {cta0, cta0, cta1, cta1}));
  }
  Decoded const d = decode(buffers);
  std::vector<CtaRow> const rows = cta_table(d, S::combine_push);
  ASSERT_EQ(rows.size(), 4u);
  for (int rank = 0; rank < 2; ++rank) {
    CtaRow const& a = rows[2 * rank];
    CtaRow const& b = rows[2 * rank + 1];
    EXPECT_EQ(a.rank, rank);
    EXPECT_EQ(a.cta, 0);
    EXPECT_EQ(a.spans, 4);               // two warps, two items each
    EXPECT_DOUBLE_EQ(a.median_us, 0.2);  // median of 0.1, 0.1, 0.3, 0.3
    EXPECT_DOUBLE_EQ(a.first_us, 0.0);
    EXPECT_DOUBLE_EQ(a.last_us, 0.4);
    EXPECT_EQ(b.cta, 1);
    EXPECT_EQ(b.spans, 2);
    EXPECT_DOUBLE_EQ(b.median_us, 0.5 + rank * 0.001);
    EXPECT_DOUBLE_EQ(b.first_us, 1.0);
    EXPECT_DOUBLE_EQ(b.last_us, 1.5 + rank * 0.001);
  }
  std::string const text = format_cta_table(rows, S::combine_push);
  EXPECT_NE(text.find("combine.push per CTA"), std::string::npos) << text;
  EXPECT_NE(text.find("    1      1        2       0.50       1.00       1.50\n"), std::string::npos) << text;
  EXPECT_TRUE(cta_table(d, S::dispatch_push).empty());
  EXPECT_NE(format_cta_table({}, S::dispatch_push).find("no spans"), std::string::npos);
}

TEST(TraceChrome, JsonParsesBackWithEveryEvent) {
  std::vector<TraceBuffer> buffers = two_ranks();
  buffers.push_back(synthetic_trace(2, TraceKernel::combine, 3, 4, 7, 123456789));  // odd: one orphan per warp
  Decoded const d = decode(buffers);
  EXPECT_EQ(d.orphan_begins, 12);
  std::ostringstream out;
  write_chrome_json(out, d);
  json::Value const doc = json::parse(out.str(), "trace.json");
  json::Value const* events = doc.find("traceEvents");
  ASSERT_NE(events, nullptr);
  ASSERT_TRUE(events->is(json::Value::Kind::array));
  std::size_t spans = 0, instants = 0, threads = 0, processes = 0;
  for (json::Value const& e : events->items) {
    ASSERT_TRUE(e.is(json::Value::Kind::object));
    std::string const ph = e.find("ph")->text;
    ASSERT_NE(e.find("pid"), nullptr);
    if (ph == "X") {
      ++spans;
      ASSERT_TRUE(e.find("ts")->is(json::Value::Kind::number));
      ASSERT_TRUE(e.find("dur")->is(json::Value::Kind::number));
      EXPECT_GE(e.find("dur")->number, 0.0);
      ASSERT_TRUE(e.find("tid")->is_integer());
      std::string const name = e.find("name")->text;
      EXPECT_EQ(name.rfind(e.find("cat")->text + ".", 0), 0u) << name;
    } else if (ph == "i") {
      ++instants;
      EXPECT_EQ(e.find("args")->find("value")->integer(), 7);
    } else if (ph == "M") {
      std::string const name = e.find("name")->text;
      threads += name == "thread_name";
      processes += name == "process_name";
    } else {
      ADD_FAILURE() << "unexpected ph " << ph;
    }
  }
  EXPECT_EQ(spans, d.spans.size());
  EXPECT_EQ(instants, d.instants.size());
  EXPECT_EQ(processes, 3u);
  EXPECT_EQ(threads, 2u + 12u);  // one warp on each of ranks 0 and 1, 12 warps on rank 2
  // the first span of rank 0 (dispatch.layout, warp 0) with exact microseconds
  bool found = false;
  for (json::Value const& e : events->items)
    if (e.find("ph")->text == "X" && e.find("name")->text == "dispatch.push" && e.find("pid")->integer() == 1) {
      EXPECT_DOUBLE_EQ(e.find("ts")->number, 0.24);
      EXPECT_DOUBLE_EQ(e.find("dur")->number, 0.8);
      found = true;
    }
  EXPECT_TRUE(found);
  json::Value const* other = doc.find("otherData");
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(other->find("orphan_begins")->integer(), 12);
}

TEST(TraceDecode, FullSyntheticBuffersDecodeExactly) {
  // functional check of the flat decoder on a sizable buffer (timing: ferry trace --selftest)
  std::vector<TraceBuffer> buffers;
  for (int rank = 0; rank < 4; ++rank)
    buffers.push_back(synthetic_trace(rank, TraceKernel::dispatch, 32, 16, 1024, rank * 1'000'000'000ll));
  Decoded const d = decode(buffers);
  EXPECT_EQ(d.spans.size(), 4u * 512 * 512);
  EXPECT_EQ(d.orphan_begins + d.orphan_ends + d.bad_events + d.dropped, 0);
  PhaseTable const table = phase_table(d);
  for (PhaseRow const& row : table.phases) {
    EXPECT_EQ(row.ranks, 4);
    EXPECT_DOUBLE_EQ(row.warp_us.median, row.warp_us.max);  // every warp and rank alike
  }
}

TEST(TraceDecode, SameResultOnAnyNumberOfThreads) {
  std::vector<TraceBuffer> buffers = two_ranks();
  for (int rank = 2; rank < 5; ++rank)  // odd capacities: one orphan begin per warp, so the output has gaps to close
    buffers.push_back(synthetic_trace(rank, TraceKernel::combine, 40, 16, 2 * rank + 1, rank * 777));
  buffers[5].counts[0] = 0;  // a silent warp
  Decoded const one = decode(buffers, {}, 1);
  for (int threads : {2, 3, 7}) {
    Decoded const many = decode(buffers, {}, threads);
    ASSERT_EQ(many.spans.size(), one.spans.size()) << threads << " threads";
    for (std::size_t i = 0; i < one.spans.size(); ++i) {
      ASSERT_EQ(many.spans[i].begin_ns, one.spans[i].begin_ns) << i;
      ASSERT_EQ(many.spans[i].end_ns, one.spans[i].end_ns) << i;
      ASSERT_EQ(many.spans[i].tid, one.spans[i].tid) << i;
      ASSERT_EQ(many.spans[i].rank, one.spans[i].rank) << i;
      ASSERT_EQ(many.spans[i].slot, one.spans[i].slot) << i;
    }
    EXPECT_EQ(many.instants.size(), one.instants.size());
    EXPECT_EQ(many.orphan_begins, one.orphan_begins);
    EXPECT_EQ(many.events, one.events);
  }
  EXPECT_EQ(one.orphan_begins, 3 * 40 * 16 - 1);
}

TEST(TraceFiles, RoundTripAndRefusals) {
  test::TempDir const scratch;
  std::filesystem::path const dir = scratch.path();
  std::vector<TraceBuffer> const buffers = two_ranks();
  for (TraceBuffer const& b : buffers) write_trace_files(dir.string(), "normal-random-64", b);
  write_trace_files(dir.string(), "other", buffers[0]);
  std::ofstream(dir / "unrelated.json") << "{\"tool\": \"ferry bench\"}";
  auto const cases = read_trace_dir(dir.string());
  ASSERT_EQ(cases.size(), 2u);
  auto const& got = cases.at("normal-random-64");
  ASSERT_EQ(got.size(), buffers.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].rank, buffers[i].rank);
    EXPECT_EQ(got[i].kernel, buffers[i].kernel);
    EXPECT_EQ(got[i].ctas, buffers[i].ctas);
    EXPECT_EQ(got[i].capacity, buffers[i].capacity);
    EXPECT_EQ(got[i].counts, buffers[i].counts);
    ASSERT_EQ(got[i].events.size(), buffers[i].events.size());
    for (std::size_t e = 0; e < got[i].events.size(); ++e) {
      EXPECT_EQ(got[i].events[e].time_ns, buffers[i].events[e].time_ns);
      EXPECT_EQ(got[i].events[e].meta, buffers[i].events[e].meta);
    }
  }
  EXPECT_THROW(write_trace_files(dir.string(), "bad/label", buffers[0]), ConfigError);

  // a truncated data file
  std::filesystem::resize_file(dir / "other.rank0.dispatch.bin", 10);
  EXPECT_THROW(read_trace_dir(dir.string()), ConfigError);
  std::filesystem::remove(dir / "other.rank0.dispatch.bin");
  std::filesystem::remove(dir / "other.rank0.dispatch.json");
  // a header written with another slot table
  std::ifstream in(dir / "normal-random-64.rank0.dispatch.json");
  std::stringstream text;
  text << in.rdbuf();
  std::string header = text.str();
  header.replace(header.find("dispatch.layout"), 15, "dispatch.layouts");
  std::ofstream(dir / "normal-random-64.rank0.dispatch.json") << header;
  EXPECT_THROW(read_trace_dir(dir.string()), ConfigError);
  EXPECT_THROW(read_trace_dir((dir / "missing").string()), ConfigError);
}

TEST(TraceApi, CpuBackendRefusesWithTheReason) {
  auto bootstraps = make_local_bootstraps(1, std::chrono::seconds(20));
  auto comm = std::shared_ptr<Communicator>(Communicator::create(std::move(bootstraps[0]), {Backend::cpu}));
  EpConfig config;
  config.hidden = 64;
  config.num_experts = 4;
  config.topk = 2;
  config.max_tokens_per_rank = 8;
  EpBuffer buffer(comm, config);
  try {
    buffer.enable_trace(64);
    FAIL() << "the cpu backend records no trace";
  } catch (ConfigError const& error) {
    std::string const what = error.what();
    if (trace_compiled_in())
      EXPECT_NE(what.find("cuda"), std::string::npos) << what;
    else
      EXPECT_NE(what.find("-DFERRY_TRACE=ON"), std::string::npos) << what;
  }
  EXPECT_THROW(buffer.read_trace(TraceKernel::dispatch), ConfigError);
}

}  // namespace
}  // namespace ferry::trace
