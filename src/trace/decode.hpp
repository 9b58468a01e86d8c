// Host side of in-kernel tracing: decodes the raw per-warp buffers of every rank (TraceBuffer), aligns the ranks'
// clocks, matches begin/end events into spans, and turns them into a Chrome / Perfetto trace and a per-phase table.
// Host-only and standard library only: compiled in every build and tested in CI on synthetic buffers.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "ferry/trace.hpp"
#include "trace/trace_format.hpp"

namespace ferry::trace {

// Where each rank's t = 0 is.
enum class Align {
  first_event,  // the rank's first event over its buffers (the traced call's start on that GPU)
  slot_end,     // the rank's first end of DecodeOptions::align_slot: an instant every rank passes together (the end
                // of dispatch.wait_counts is when the last rank's counts arrived); first_event where it is missing
  raw,          // the global timers as recorded, minus the smallest over all ranks (GPUs of one host share it)
};
char const* align_name(Align align);
Align parse_align(std::string const& name);  // "first" | "slot" | "raw"; ConfigError otherwise

struct DecodeOptions {
  Align align = Align::first_event;
  TraceSlot align_slot = TraceSlot::dispatch_wait_counts;
};

// A matched begin/end pair. Times are nanoseconds after the rank's t = 0.
struct Span {
  int64_t begin_ns;
  int64_t end_ns;
  uint32_t tid;  // cta * warps_per_cta + warp
  uint16_t rank;
  uint8_t slot;   // TraceSlot
  uint8_t depth;  // nesting depth within the warp (0: outermost)
};

struct Instant {
  int64_t time_ns;
  uint32_t tid;
  uint32_t value;
  uint16_t rank;
  uint8_t slot;
};

// One decoded buffer: which rank and kernel, its t = 0 on the raw clock, and its events' extent after alignment.
struct BufferInfo {
  int rank = 0;
  TraceKernel kernel = TraceKernel::dispatch;
  int ctas = 0;
  int warps_per_cta = 0;
  int64_t t0_ns = 0;     // raw timer value that became 0 for this rank
  int64_t first_ns = 0;  // first and last event of the buffer, aligned (window of the kernel on the rank)
  int64_t last_ns = 0;
  int64_t events = 0;  // events read (written ones)
};

// An allocator whose value-less construct leaves trivial elements uninitialised: the decoder sizes its output for the
// most spans the events can hold and writes each one it keeps, so zero-filling it first would be a wasted pass.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(DefaultInitAllocator<U> const&) noexcept {}
  template <typename U>
  void construct(U* ptr) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(ptr)) U;
  }
  template <typename U, typename... Args>
  void construct(U* ptr, Args&&... args) {
    ::new (static_cast<void*>(ptr)) U(std::forward<Args>(args)...);
  }
};

struct Decoded {
  std::vector<Span, DefaultInitAllocator<Span>> spans;  // in buffer order, then warp order, then end time
  std::vector<Instant> instants;
  std::vector<BufferInfo> buffers;
  int64_t events = 0;           // events read
  int64_t dropped = 0;          // events warps recorded past their capacity (never written)
  int64_t orphan_begins = 0;    // begins without their end (dropped, timed out, or ended by an outer span's end)
  int64_t orphan_ends = 0;      // ends without a begin
  int64_t bad_events = 0;       // unknown slot or kind, a slot of another kernel, or a warp id that is not the buffer's
  int64_t unaligned_ranks = 0;  // Align::slot_end: ranks without the slot, aligned on their first event instead
};

// Decodes every buffer: one pass over the events, no allocation per event, warps split over up to `threads` threads
// (0: the hardware's, at most 16, one per 2M events). The result does not depend on the number of threads. Throws
// InputError for a buffer whose arrays do not match its geometry.
Decoded decode(std::span<TraceBuffer const> buffers, DecodeOptions const& options = {}, int threads = 0);

// Chrome trace JSON (chrome://tracing, ui.perfetto.dev): spans as complete events (ph "X"), instants as ph "i",
// pid = rank, tid = cta * warps_per_cta + warp, timestamps in microseconds; process and thread names as metadata;
// the decode counters under "otherData".
void write_chrome_json(std::ostream& out, Decoded const& decoded);

// Per phase, across ranks (min / median / max): warp_us = mean time a warp that entered the phase spent in it;
// extent_us = from the phase's first begin to its last end on the rank; share = extent / the rank's window of the
// kernel (its first to last event); begin_us / end_us = the phase's first begin and last end, from the start of the
// rank's window (where the phase sits on the kernel's timeline: a phase whose warps are short but whose end is late
// waits for something earlier).
struct Stat {
  double min = 0, median = 0, max = 0;
};
struct PhaseRow {
  TraceSlot slot = TraceSlot::dispatch_layout;
  int ranks = 0;      // ranks that recorded the phase
  int64_t spans = 0;  // over all ranks
  Stat warp_us;
  Stat extent_us;
  Stat share;  // fraction of the window, 0..1
  Stat begin_us;
  Stat end_us;
};
struct WindowRow {
  TraceKernel kernel = TraceKernel::dispatch;
  int ranks = 0;
  Stat window_us;
};
struct PhaseTable {
  std::vector<WindowRow> windows;
  std::vector<PhaseRow> phases;  // slot order
};
PhaseTable phase_table(Decoded const& decoded);

// The table as text (one line per phase, windows first, then the decode counters).
std::string format_phase_table(PhaseTable const& table, Decoded const& decoded);

// One phase per (rank, CTA), rank then CTA order: the CTA's spans of the phase over its warps, their median duration,
// and the first begin and last end from the start of the rank's window of the kernel. The phase table's medians hide
// a grid whose CTAs differ (roles, or work items that fall to CTAs by a pattern: in the normal combine the push items
// of one peer land on every other CTA); this shows it.
struct CtaRow {
  int rank = 0;
  int cta = 0;
  int64_t spans = 0;
  double median_us = 0;
  double first_us = 0;
  double last_us = 0;
};
std::vector<CtaRow> cta_table(Decoded const& decoded, TraceSlot slot);

// The rows as text: a header naming the phase, one line per (rank, CTA).
std::string format_cta_table(std::vector<CtaRow> const& rows, TraceSlot slot);

// The slot names this build decodes, in slot order (written into trace files and compared when reading them).
std::vector<std::string> slot_names();

}  // namespace ferry::trace
