#include "trace/decode.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <thread>

#include "ferry/error.hpp"

namespace ferry {

char const* trace_kernel_name(TraceKernel kernel) {
  switch (kernel) {
    case TraceKernel::dispatch:
      return "dispatch";
    case TraceKernel::combine:
      return "combine";
    case TraceKernel::ll_dispatch:
      return "ll_dispatch";
    case TraceKernel::ll_combine:
      return "ll_combine";
  }
  return "unknown";
}

TraceKernel parse_trace_kernel(std::string const& name) {
  for (int k = 0; k < kNumTraceKernels; ++k)
    if (name == trace_kernel_name(static_cast<TraceKernel>(k))) return static_cast<TraceKernel>(k);
  FERRY_THROW(ConfigError, "config", "trace kernel '", name,
              "' is unknown; use dispatch, combine, ll_dispatch or ll_combine");
}

bool trace_compiled_in() {
#if FERRY_TRACE
  return true;
#else
  return false;
#endif
}

namespace trace {
namespace {

constexpr int kMaxDepth = 16;
constexpr uint64_t kIdMask = 0xfffffc00ull;  // meta bits of the warp and CTA ids

struct Open {
  int64_t begin;
  uint8_t slot;
};

void check_geometry(TraceBuffer const& b) {
  FERRY_CHECK_INPUT(b.ctas >= 0 && b.warps_per_cta >= 0 && b.capacity >= 0, "trace buffer of rank ", b.rank,
                    " has a negative geometry (ctas=", b.ctas, " warps_per_cta=", b.warps_per_cta,
                    " capacity=", b.capacity, ")");
  FERRY_CHECK_INPUT(b.warps_per_cta <= kMaxWarpsPerCta, "trace buffer of rank ", b.rank,
                    " has warps_per_cta=", b.warps_per_cta, "; at most ", kMaxWarpsPerCta,
                    " fit the event's warp field");
  std::size_t const warps = static_cast<std::size_t>(b.num_warps());
  FERRY_CHECK_INPUT(b.counts.size() == warps && b.events.size() == warps * static_cast<std::size_t>(b.capacity),
                    "trace buffer of rank ", b.rank, " (", trace_kernel_name(b.kernel), ") holds ", b.counts.size(),
                    " counts and ", b.events.size(), " events; its geometry (", b.ctas, " CTAs x ", b.warps_per_cta,
                    " warps x ", b.capacity, " events) needs ", warps, " and ",
                    warps * static_cast<std::size_t>(b.capacity));
}

// First and last written event of a buffer on the raw clock (each warp's events are in time order).
std::pair<int64_t, int64_t> raw_extent(TraceBuffer const& b) {
  int64_t first = std::numeric_limits<int64_t>::max();
  int64_t last = std::numeric_limits<int64_t>::min();
  for (int w = 0; w < b.num_warps(); ++w) {
    uint32_t const n = std::min<uint32_t>(b.counts[w], static_cast<uint32_t>(b.capacity));
    if (n == 0) continue;
    TraceEvent const* ev = b.events.data() + static_cast<std::size_t>(w) * b.capacity;
    first = std::min(first, static_cast<int64_t>(ev[0].time_ns));
    last = std::max(last, static_cast<int64_t>(ev[n - 1].time_ns));
  }
  return {first, last};
}

int64_t first_end_of(TraceBuffer const& b, TraceSlot slot) {
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int w = 0; w < b.num_warps(); ++w) {
    uint32_t const n = std::min<uint32_t>(b.counts[w], static_cast<uint32_t>(b.capacity));
    TraceEvent const* ev = b.events.data() + static_cast<std::size_t>(w) * b.capacity;
    for (uint32_t i = 0; i < n; ++i)
      if (meta_slot(ev[i].meta) == static_cast<uint32_t>(slot) &&
          meta_kind(ev[i].meta) == static_cast<uint32_t>(TraceEventKind::end)) {
        best = std::min(best, static_cast<int64_t>(ev[i].time_ns));
        break;  // later events of this warp are later
      }
  }
  return best;
}

Stat stat_of(std::vector<double> values) {
  Stat s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  std::size_t const n = values.size();
  s.min = values.front();
  s.max = values.back();
  s.median = n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
  return s;
}

// Each (rank, kernel)'s window on the rank's timeline: the first to the last event over the rank's buffers of that
// kernel that recorded any (phase_table's shares and the per-CTA table's times are measured from its start).
struct Window {
  int64_t first;
  int64_t last;
};
std::map<std::pair<int, TraceKernel>, Window> kernel_windows(Decoded const& decoded) {
  std::map<std::pair<int, TraceKernel>, Window> windows;
  for (BufferInfo const& info : decoded.buffers) {
    if (info.events == 0) continue;
    auto [it, fresh] = windows.try_emplace({info.rank, info.kernel}, Window{info.first_ns, info.last_ns});
    if (!fresh) it->second = Window{std::min(it->second.first, info.first_ns), std::max(it->second.last, info.last_ns)};
  }
  return windows;
}

// Nanoseconds as microseconds with three decimals, exactly ("-1.250").
char* put_us(char* p, int64_t ns) {
  if (ns < 0) {
    *p++ = '-';
    ns = -ns;
  }
  p = std::to_chars(p, p + 24, ns / 1000).ptr;
  int64_t const frac = ns % 1000;
  *p++ = '.';
  *p++ = static_cast<char>('0' + frac / 100);
  *p++ = static_cast<char>('0' + frac / 10 % 10);
  *p++ = static_cast<char>('0' + frac % 10);
  return p;
}

template <typename T>
char* put_int(char* p, T value) {
  return std::to_chars(p, p + 24, value).ptr;
}

char* put_str(char* p, char const* text) {
  while (*text) *p++ = *text++;
  return p;
}

}  // namespace

char const* align_name(Align align) {
  switch (align) {
    case Align::first_event:
      return "first";
    case Align::slot_end:
      return "slot";
    case Align::raw:
      return "raw";
  }
  return "unknown";
}

Align parse_align(std::string const& name) {
  for (Align a : {Align::first_event, Align::slot_end, Align::raw})
    if (name == align_name(a)) return a;
  FERRY_THROW(ConfigError, "config", "alignment '", name,
              "' is unknown; use first (each rank's first event), slot (the end of a phase every rank passes "
              "together) or raw (the GPUs' timers as recorded)");
}

std::vector<std::string> slot_names() {
  return std::vector<std::string>(std::begin(kSlotNames), std::end(kSlotNames));
}

namespace {

// Step 1: each rank's t = 0 on its raw clock (the earliest of its buffers' first events, the first end of the
// alignment slot, or everyone's first event: Align), and each buffer's raw extent.
std::map<int, int64_t> rank_zeros(std::span<TraceBuffer const> buffers, DecodeOptions const& options,
                                  std::vector<std::pair<int64_t, int64_t>>& extents, Decoded& out) {
  std::map<int, int64_t> t0;  // rank -> raw time of its t = 0
  int64_t global_first = std::numeric_limits<int64_t>::max();
  for (TraceBuffer const& b : buffers) {
    extents.push_back(raw_extent(b));
    auto const [it, fresh] = t0.try_emplace(b.rank, extents.back().first);
    if (!fresh) it->second = std::min(it->second, extents.back().first);
    global_first = std::min(global_first, extents.back().first);
  }
  if (options.align == Align::raw) {
    for (auto& [rank, time] : t0) time = global_first;
  } else if (options.align == Align::slot_end) {
    std::map<int, int64_t> slot_time;
    for (TraceBuffer const& b : buffers) {
      if (kSlotKernel[static_cast<int>(options.align_slot)] != b.kernel) continue;
      int64_t const time = first_end_of(b, options.align_slot);
      auto const [it, fresh] = slot_time.try_emplace(b.rank, time);
      if (!fresh) it->second = std::min(it->second, time);
    }
    for (auto& [rank, time] : t0) {
      auto const it = slot_time.find(rank);
      if (it != slot_time.end() && it->second != std::numeric_limits<int64_t>::max())
        time = it->second;
      else
        ++out.unaligned_ranks;
    }
  }
  return t0;
}

// One warp's events of step 2, and the spans it wrote at its bound.
struct WarpJob {
  uint32_t buffer;
  uint32_t warp;
  std::size_t bound;  // first span slot of the warp
};

// What a thread of step 2 counts.
struct Counters {
  int64_t dropped = 0, orphan_begins = 0, orphan_ends = 0, bad = 0;
  std::vector<Instant> instants;
};

// Step 2 for one warp: spans by matching begin/end on a small stack (written from dst on), instants as they come.
// Returns the spans written.
uint32_t decode_warp(TraceBuffer const& b, int w, int64_t zero, Span* dst, Counters& c) {
  Span* const first = dst;
  uint32_t const count = b.counts[w];
  uint32_t const n = std::min<uint32_t>(count, static_cast<uint32_t>(b.capacity));
  c.dropped += count - n;
  uint64_t const ids =
      event_meta(0, 0, static_cast<uint32_t>(w / b.warps_per_cta), static_cast<uint32_t>(w % b.warps_per_cta), 0);
  uint32_t const tid = static_cast<uint32_t>(w);
  uint16_t const rank = static_cast<uint16_t>(b.rank);
  TraceEvent const* ev = b.events.data() + static_cast<std::size_t>(w) * b.capacity;
  Open stack[kMaxDepth];
  int depth = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t const meta = ev[i].meta;
    uint32_t const slot = meta_slot(meta);
    uint32_t const kind = meta_kind(meta);
    if (slot >= static_cast<uint32_t>(kNumSlots) || kSlotKernel[slot] != b.kernel || (meta & kIdMask) != ids) {
      ++c.bad;
      continue;
    }
    int64_t const t = static_cast<int64_t>(ev[i].time_ns) - zero;
    if (kind == static_cast<uint32_t>(TraceEventKind::begin)) {
      if (depth == kMaxDepth) {
        ++c.bad;  // deeper than any kernel nests
        continue;
      }
      stack[depth++] = {t, static_cast<uint8_t>(slot)};
    } else if (kind == static_cast<uint32_t>(TraceEventKind::end)) {
      int k = depth - 1;
      while (k >= 0 && stack[k].slot != slot) --k;
      if (k < 0) {
        ++c.orphan_ends;
        continue;
      }
      c.orphan_begins += depth - 1 - k;  // spans opened inside this one and never ended
      depth = k;
      *dst++ = Span{stack[k].begin, t, tid, rank, static_cast<uint8_t>(slot), static_cast<uint8_t>(k)};
    } else if (kind == static_cast<uint32_t>(TraceEventKind::instant)) {
      c.instants.push_back(Instant{t, tid, meta_payload(meta), rank, static_cast<uint8_t>(slot)});
    } else {
      ++c.bad;
    }
  }
  c.orphan_begins += depth;
  return static_cast<uint32_t>(dst - first);
}

// Where step 2's threads split the jobs: contiguous runs of warps with about the same number of events each
// (num_threads + 1 cuts, the first 0 and the last jobs.size()).
std::vector<std::size_t> job_cuts(std::span<TraceBuffer const> buffers, std::vector<WarpJob> const& jobs,
                                  std::size_t total_events, std::size_t num_threads) {
  std::vector<std::size_t> cuts{0};
  std::size_t acc = 0, next = 1;
  for (std::size_t j = 0; j < jobs.size() && next < num_threads; ++j) {
    TraceBuffer const& b = buffers[jobs[j].buffer];
    acc += std::min<uint32_t>(b.counts[jobs[j].warp], static_cast<uint32_t>(b.capacity));
    if (acc * num_threads >= total_events * next) {
      cuts.push_back(j + 1);
      ++next;
    }
  }
  while (cuts.size() <= num_threads) cuts.push_back(jobs.size());
  return cuts;
}

// Step 3: what each buffer holds, on its rank's clock.
void describe_buffers(std::span<TraceBuffer const> buffers, std::map<int, int64_t> const& t0,
                      std::vector<std::pair<int64_t, int64_t>> const& extents, Decoded& out) {
  for (std::size_t bi = 0; bi < buffers.size(); ++bi) {
    TraceBuffer const& b = buffers[bi];
    int64_t const zero = t0.at(b.rank);
    BufferInfo info;
    info.rank = b.rank;
    info.kernel = b.kernel;
    info.ctas = b.ctas;
    info.warps_per_cta = b.warps_per_cta;
    info.t0_ns = zero;
    bool const any = extents[bi].first != std::numeric_limits<int64_t>::max();
    info.first_ns = any ? extents[bi].first - zero : 0;
    info.last_ns = any ? extents[bi].second - zero : 0;
    for (uint32_t c : b.counts) info.events += std::min<uint32_t>(c, static_cast<uint32_t>(b.capacity));
    out.events += info.events;
    out.buffers.push_back(info);
  }
}

}  // namespace

Decoded decode(std::span<TraceBuffer const> buffers, DecodeOptions const& options, int threads) {
  Decoded out;
  for (TraceBuffer const& b : buffers) check_geometry(b);
  std::vector<std::pair<int64_t, int64_t>> extents;
  std::map<int, int64_t> const t0 = rank_zeros(buffers, options, extents, out);  // 1.

  // 2. one pass over every warp's events. Warp j writes its spans at its bound (events / 2 before it), threads take
  //    contiguous runs of warps, and a serial pass closes the gaps, so the output is in (buffer, warp) order whatever
  //    the number of threads.
  std::vector<WarpJob> jobs;
  std::size_t total_bound = 0, total_events = 0;
  for (std::size_t bi = 0; bi < buffers.size(); ++bi) {
    TraceBuffer const& b = buffers[bi];
    for (int w = 0; w < b.num_warps(); ++w) {
      uint32_t const n = std::min<uint32_t>(b.counts[w], static_cast<uint32_t>(b.capacity));
      jobs.push_back(WarpJob{static_cast<uint32_t>(bi), static_cast<uint32_t>(w), total_bound});
      total_bound += n / 2;
      total_events += n;
    }
  }
  out.spans.resize(total_bound);
  std::vector<uint32_t> kept(jobs.size(), 0);  // spans each warp kept
  auto run = [&](std::size_t job_begin, std::size_t job_end, Counters& c) {
    for (std::size_t j = job_begin; j < job_end; ++j) {
      TraceBuffer const& b = buffers[jobs[j].buffer];
      kept[j] = decode_warp(b, static_cast<int>(jobs[j].warp), t0.at(b.rank), out.spans.data() + jobs[j].bound, c);
    }
  };
  // NOTE: unless the caller asks for a number, a thread is worth its start-up only per few million events.
  unsigned const hardware = std::max(1u, std::thread::hardware_concurrency());
  std::size_t const wanted = threads > 0 ? static_cast<std::size_t>(threads)
                                         : std::min<std::size_t>({std::min(hardware, 16u), total_events >> 21});
  std::size_t const num_threads = std::clamp<std::size_t>(wanted, 1, std::max<std::size_t>(1, jobs.size()));
  std::vector<Counters> counters(num_threads);
  {
    std::vector<std::size_t> const cuts = job_cuts(buffers, jobs, total_events, num_threads);
    std::vector<std::thread> workers;
    for (std::size_t t = 1; t < num_threads; ++t)
      workers.emplace_back(run, cuts[t], cuts[t + 1], std::ref(counters[t]));
    run(cuts[0], cuts[1], counters[0]);
    for (std::thread& worker : workers) worker.join();
  }
  // close the gaps (none when every event paired up)
  std::size_t write = 0;
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    if (write != jobs[j].bound && kept[j] > 0)
      std::memmove(out.spans.data() + write, out.spans.data() + jobs[j].bound, kept[j] * sizeof(Span));
    write += kept[j];
  }
  out.spans.resize(write);
  for (Counters& c : counters) {
    out.dropped += c.dropped;
    out.orphan_begins += c.orphan_begins;
    out.orphan_ends += c.orphan_ends;
    out.bad_events += c.bad;
    out.instants.insert(out.instants.end(), c.instants.begin(), c.instants.end());
  }
  describe_buffers(buffers, t0, extents, out);  // 3.
  return out;
}

void write_chrome_json(std::ostream& out, Decoded const& decoded) {
  // NOTE: written through one fixed buffer with to_chars (no per-event allocation or locale).
  std::vector<char> buffer(1 << 20);
  char* const begin = buffer.data();
  char* const limit = begin + buffer.size() - 512;  // one event is far below 512 bytes
  char* p = begin;
  auto flush = [&](bool force) {
    if (force || p > limit) {
      out.write(begin, p - begin);
      p = begin;
    }
  };
  bool first = true;
  auto sep = [&] {
    if (!first) *p++ = ',';
    *p++ = '\n';
    first = false;
  };
  p = put_str(p, "{\"traceEvents\":[");
  // names: one process per rank, one thread per warp that recorded something
  std::map<int, int> warps_per_cta;  // rank -> warps per CTA (the same for every kernel of a rank)
  for (BufferInfo const& info : decoded.buffers) warps_per_cta[info.rank] = std::max(1, info.warps_per_cta);
  for (auto const& [rank, wpc] : warps_per_cta) {
    sep();
    p = put_str(p, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":");
    p = put_int(p, rank);
    p = put_str(p, ",\"args\":{\"name\":\"rank ");
    p = put_int(p, rank);
    p = put_str(p, "\"}}");
    sep();
    p = put_str(p, "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":");
    p = put_int(p, rank);
    p = put_str(p, ",\"args\":{\"sort_index\":");
    p = put_int(p, rank);
    p = put_str(p, "}}");
  }
  std::vector<std::pair<int, uint32_t>> threads;
  threads.reserve(decoded.spans.size() / 8 + 16);
  for (Span const& s : decoded.spans)
    if (threads.empty() || threads.back() != std::make_pair(static_cast<int>(s.rank), s.tid))
      threads.emplace_back(s.rank, s.tid);
  for (Instant const& i : decoded.instants) threads.emplace_back(i.rank, i.tid);
  std::sort(threads.begin(), threads.end());
  threads.erase(std::unique(threads.begin(), threads.end()), threads.end());
  for (auto const& [rank, tid] : threads) {
    int const wpc = warps_per_cta.count(rank) ? warps_per_cta.at(rank) : 1;
    sep();
    p = put_str(p, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":");
    p = put_int(p, rank);
    p = put_str(p, ",\"tid\":");
    p = put_int(p, tid);
    p = put_str(p, ",\"args\":{\"name\":\"cta ");
    p = put_int(p, tid / wpc);
    p = put_str(p, " warp ");
    p = put_int(p, tid % wpc);
    p = put_str(p, "\"}}");
    flush(false);
  }
  // {"name":<slot>,"cat":<kernel>,"ph":<phase>,"pid":<rank>,"tid":<warp>,"ts":<time>: what every event starts with
  auto put_event_head = [&](int slot, char const* phase, int rank, uint32_t tid, int64_t time_ns) {
    sep();
    p = put_str(p, "{\"name\":\"");
    p = put_str(p, kSlotNames[slot]);
    p = put_str(p, "\",\"cat\":\"");
    p = put_str(p, trace_kernel_name(kSlotKernel[slot]));
    p = put_str(p, "\",\"ph\":");
    p = put_str(p, phase);
    p = put_str(p, ",\"pid\":");
    p = put_int(p, rank);
    p = put_str(p, ",\"tid\":");
    p = put_int(p, tid);
    p = put_str(p, ",\"ts\":");
    p = put_us(p, time_ns);
  };
  for (Span const& s : decoded.spans) {
    put_event_head(s.slot, "\"X\"", s.rank, s.tid, s.begin_ns);
    p = put_str(p, ",\"dur\":");
    p = put_us(p, s.end_ns - s.begin_ns);
    *p++ = '}';
    flush(false);
  }
  for (Instant const& i : decoded.instants) {
    put_event_head(i.slot, "\"i\",\"s\":\"t\"", i.rank, i.tid, i.time_ns);
    p = put_str(p, ",\"args\":{\"value\":");
    p = put_int(p, i.value);
    p = put_str(p, "}}");
    flush(false);
  }
  p = put_str(p, "\n],\"displayTimeUnit\":\"ns\",\"otherData\":{\"events\":");
  p = put_int(p, decoded.events);
  p = put_str(p, ",\"dropped\":");
  p = put_int(p, decoded.dropped);
  p = put_str(p, ",\"orphan_begins\":");
  p = put_int(p, decoded.orphan_begins);
  p = put_str(p, ",\"orphan_ends\":");
  p = put_int(p, decoded.orphan_ends);
  p = put_str(p, ",\"bad_events\":");
  p = put_int(p, decoded.bad_events);
  p = put_str(p, "}}\n");
  flush(true);
}

PhaseTable phase_table(Decoded const& decoded) {
  // rank -> dense index
  std::map<int, int> rank_index;
  for (BufferInfo const& info : decoded.buffers) rank_index.try_emplace(info.rank, 0);
  int next = 0;
  for (auto& [r, i] : rank_index) i = next++;
  int const num_ranks = next;

  auto const windows_of = kernel_windows(decoded);

  // per (rank, slot): spans, summed duration, distinct warps, first begin, last end
  struct Acc {
    int64_t spans = 0;
    int64_t sum_ns = 0;
    int64_t warps = 0;
    int64_t first = 0;
    int64_t last = 0;
    int64_t last_tid = -1;
  };
  std::vector<Acc> acc(static_cast<std::size_t>(num_ranks) * kNumSlots);
  int last_rank = -1, last_index = 0;
  for (Span const& s : decoded.spans) {
    if (s.rank != last_rank) {
      last_rank = s.rank;
      last_index = rank_index.at(s.rank);
    }
    Acc& a = acc[static_cast<std::size_t>(last_index) * kNumSlots + s.slot];
    if (a.spans == 0) {
      a.first = s.begin_ns;
      a.last = s.end_ns;
    } else {
      a.first = std::min(a.first, s.begin_ns);
      a.last = std::max(a.last, s.end_ns);
    }
    ++a.spans;
    a.sum_ns += s.end_ns - s.begin_ns;
    if (a.last_tid != s.tid) {  // a warp's spans are contiguous in decode order
      ++a.warps;
      a.last_tid = s.tid;
    }
  }

  PhaseTable table;
  for (int k = 0; k < kNumTraceKernels; ++k) {
    std::vector<double> windows;
    for (auto const& [rank, r] : rank_index)
      if (auto const w = windows_of.find({rank, static_cast<TraceKernel>(k)}); w != windows_of.end())
        windows.push_back(static_cast<double>(w->second.last - w->second.first) / 1e3);
    if (windows.empty()) continue;
    table.windows.push_back(WindowRow{static_cast<TraceKernel>(k), static_cast<int>(windows.size()), stat_of(windows)});
  }
  for (int slot = 0; slot < kNumSlots; ++slot) {
    std::vector<double> warp_us, extent_us, share, begin_us, end_us;
    PhaseRow row;
    row.slot = static_cast<TraceSlot>(slot);
    for (auto const& [rank, r] : rank_index) {
      Acc const& a = acc[static_cast<std::size_t>(r) * kNumSlots + slot];
      if (a.spans == 0) continue;
      row.spans += a.spans;
      warp_us.push_back(static_cast<double>(a.sum_ns) / static_cast<double>(a.warps) / 1e3);
      double const extent = static_cast<double>(a.last - a.first) / 1e3;
      extent_us.push_back(extent);
      auto const w = windows_of.find({rank, kSlotKernel[slot]});
      bool const has_window = w != windows_of.end();
      double const window = has_window ? static_cast<double>(w->second.last - w->second.first) / 1e3 : 0.0;
      share.push_back(window > 0 ? extent / window : 0.0);
      int64_t const start = has_window ? w->second.first : a.first;
      begin_us.push_back(static_cast<double>(a.first - start) / 1e3);
      end_us.push_back(static_cast<double>(a.last - start) / 1e3);
    }
    if (warp_us.empty()) continue;
    row.ranks = static_cast<int>(warp_us.size());
    row.warp_us = stat_of(warp_us);
    row.extent_us = stat_of(extent_us);
    row.share = stat_of(share);
    row.begin_us = stat_of(begin_us);
    row.end_us = stat_of(end_us);
    table.phases.push_back(row);
  }
  return table;
}

std::string format_phase_table(PhaseTable const& table, Decoded const& decoded) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof(line), "%-24s %5s %10s %10s %10s\n", "window (first..last event)", "ranks", "min_us",
                "median_us", "max_us");
  out += line;
  for (WindowRow const& w : table.windows) {
    std::snprintf(line, sizeof(line), "%-24s %5d %10.2f %10.2f %10.2f\n", trace_kernel_name(w.kernel), w.ranks,
                  w.window_us.min, w.window_us.median, w.window_us.max);
    out += line;
  }
  std::snprintf(line, sizeof(line), "\n%-24s %5s %8s  %-26s  %-26s  %-20s  %-17s\n", "phase", "ranks", "spans",
                "warp_us min/median/max", "extent_us min/median/max", "share % min/med/max", "begin..end_us med");
  out += line;
  for (PhaseRow const& r : table.phases) {
    std::snprintf(line, sizeof(line),
                  "%-24s %5d %8lld  %8.2f %8.2f %8.2f  %8.2f %8.2f %8.2f  %6.1f %6.1f %6.1f  %7.2f..%.2f\n",
                  kSlotNames[static_cast<int>(r.slot)], r.ranks, static_cast<long long>(r.spans), r.warp_us.min,
                  r.warp_us.median, r.warp_us.max, r.extent_us.min, r.extent_us.median, r.extent_us.max,
                  100 * r.share.min, 100 * r.share.median, 100 * r.share.max, r.begin_us.median, r.end_us.median);
    out += line;
  }
  std::snprintf(line, sizeof(line),
                "\nevents %lld, dropped %lld (past a warp's capacity), orphan begins %lld, orphan ends %lld, bad %lld",
                static_cast<long long>(decoded.events), static_cast<long long>(decoded.dropped),
                static_cast<long long>(decoded.orphan_begins), static_cast<long long>(decoded.orphan_ends),
                static_cast<long long>(decoded.bad_events));
  out += line;
  if (decoded.unaligned_ranks > 0) {
    std::snprintf(line, sizeof(line), ", %lld rank(s) without the alignment slot (aligned on their first event)",
                  static_cast<long long>(decoded.unaligned_ranks));
    out += line;
  }
  out += "\n";
  return out;
}

std::vector<CtaRow> cta_table(Decoded const& decoded, TraceSlot slot) {
  TraceKernel const kernel = kSlotKernel[static_cast<int>(slot)];
  auto const windows = kernel_windows(decoded);
  std::map<int, int> warps_per_cta;  // rank -> warps per CTA of the kernel's buffers
  for (BufferInfo const& info : decoded.buffers)
    if (info.kernel == kernel) warps_per_cta[info.rank] = std::max(1, info.warps_per_cta);
  struct Acc {
    std::vector<int64_t> durations;
    int64_t first = 0;
    int64_t last = 0;
  };
  std::map<std::pair<int, int>, Acc> per_cta;
  for (Span const& s : decoded.spans) {
    if (s.slot != static_cast<uint8_t>(slot)) continue;
    auto const wpc = warps_per_cta.find(s.rank);
    if (wpc == warps_per_cta.end()) continue;
    int const cta = static_cast<int>(s.tid) / wpc->second;
    Acc& a = per_cta[{s.rank, cta}];
    a.first = a.durations.empty() ? s.begin_ns : std::min(a.first, s.begin_ns);
    a.last = a.durations.empty() ? s.end_ns : std::max(a.last, s.end_ns);
    a.durations.push_back(s.end_ns - s.begin_ns);
  }
  std::vector<CtaRow> rows;
  rows.reserve(per_cta.size());
  for (auto& [key, a] : per_cta) {
    std::vector<double> us(a.durations.size());
    std::transform(a.durations.begin(), a.durations.end(), us.begin(),
                   [](int64_t ns) { return static_cast<double>(ns) / 1e3; });
    int64_t const start = windows.at({key.first, kernel}).first;  // a span is an event: its window exists
    rows.push_back(CtaRow{key.first, key.second, static_cast<int64_t>(a.durations.size()), stat_of(us).median,
                          static_cast<double>(a.first - start) / 1e3, static_cast<double>(a.last - start) / 1e3});
  }
  return rows;
}

std::string format_cta_table(std::vector<CtaRow> const& rows, TraceSlot slot) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof(line),
                "\n%s per CTA (span us: median over the CTA's warps; first begin / last end from the "
                "start of the rank's window)\n%5s %6s %8s %10s %10s %10s\n",
                kSlotNames[static_cast<int>(slot)], "rank", "cta", "spans", "median_us", "first_us", "last_us");
  out += line;
  for (CtaRow const& r : rows) {
    std::snprintf(line, sizeof(line), "%5d %6d %8lld %10.2f %10.2f %10.2f\n", r.rank, r.cta,
                  static_cast<long long>(r.spans), r.median_us, r.first_us, r.last_us);
    out += line;
  }
  if (rows.empty()) out += "(no spans of this phase)\n";
  return out;
}

}  // namespace trace
}  // namespace ferry
