#include "p2p_settings.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "ferry/error.hpp"

namespace ferry::cli::p2p {
namespace {

constexpr Op kAllOps[] = {Op::push, Op::pull, Op::copy_engine, Op::latency, Op::put_signal};
constexpr Direction kAllDirections[] = {Direction::oneway, Direction::bidir, Direction::alltoall};
constexpr transport::Kind kTransports[] = {transport::Kind::lsa, transport::Kind::emulated, transport::Kind::gin};

// NOTE: the emulated delay is waited once per delivery (every signal), so a second already makes a measure crawl.
constexpr int kMaxEmulatedDelayNs = 1000000000;

std::vector<std::string> split_list(std::string const& text) {
  std::vector<std::string> out;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) out.push_back(item);
  return out;
}

template <class T, std::size_t N, class Name>
std::string names(T const (&values)[N], Name name) {
  std::string out;
  for (T const& value : values) out += (out.empty() ? "" : ", ") + std::string(name(value));
  return out;
}

std::string op_names(std::vector<Op> const& ops, char const* separator) {
  std::string out;
  for (Op op : ops) out += (out.empty() ? "" : separator) + std::string(op_name(op));
  return out;
}

transport::Kind transport_of(std::string const& text) {
  for (transport::Kind kind : kTransports)
    if (text == transport::kind_name(kind)) return kind;
  FERRY_THROW(ConfigError, "config", "--transport: '", text, "' is not one of ",
              names(kTransports, transport::kind_name));
}

Op op_of(std::string const& text, transport::Kind kind) {
  std::vector<Op> const allowed = ops_of(kind);
  for (Op op : kAllOps) {
    if (text != op_name(op)) continue;
    FERRY_CHECK_CONFIG(std::find(allowed.begin(), allowed.end(), op) != allowed.end(), "--ops: '", text,
                       "' is not measured over --transport ", transport::kind_name(kind),
                       " (a network peer is reached by puts and signals only: no loads, no copy engine); use ",
                       op_names(allowed, ", "));
    return op;
  }
  FERRY_THROW(ConfigError, "config", "--ops: '", text, "' is unknown; use ", op_names(allowed, ", "), " (--transport ",
              transport::kind_name(kind), ")");
}

Direction direction_of(std::string const& text) {
  for (Direction direction : kAllDirections)
    if (text == direction_name(direction)) return direction;
  FERRY_THROW(ConfigError, "config", "--directions: '", text, "' is unknown; use ",
              names(kAllDirections, direction_name));
}

// A non-negative integer option that may exceed int (the emulated seed).
uint64_t unsigned_option(Options const& options, std::string const& name) {
  std::string const& text = options.str(name);
  errno = 0;
  char* end = nullptr;
  unsigned long long const value = std::strtoull(text.c_str(), &end, 10);
  FERRY_CHECK_CONFIG(!text.empty() && text[0] != '-' && errno == 0 && *end == '\0', "--", name, "=", text,
                     " is not a non-negative integer");
  return value;
}

transport::EmulatedOptions emulated_from(Options const& options, transport::Kind kind) {
  for (char const* name : {"emulated-delay-ns", "emulated-seed", "emulated-reorder"})
    FERRY_CHECK_CONFIG(kind == transport::Kind::emulated || !options.given(name), "--", name,
                       " sets the emulated transport, but --transport is ", transport::kind_name(kind),
                       "; add --transport emulated or drop --", name);
  transport::EmulatedOptions out;
  uint64_t const delay = unsigned_option(options, "emulated-delay-ns");
  FERRY_CHECK_CONFIG(delay <= kMaxEmulatedDelayNs, "--emulated-delay-ns=", delay, " is outside [0, ",
                     kMaxEmulatedDelayNs, "] (nanoseconds each delivery waits at most; 0: none)");
  out.max_delay_ns = static_cast<uint32_t>(delay);
  out.seed = unsigned_option(options, "emulated-seed");
  std::string const& reorder = options.str("emulated-reorder");
  FERRY_CHECK_CONFIG(reorder == "0" || reorder == "1", "--emulated-reorder=", reorder,
                     " must be 1 (deliver puts and their 16-byte pieces in a seeded order) or 0 (in issue order)");
  out.reorder = reorder == "1";
  return out;
}

}  // namespace

char const* op_name(Op op) {
  switch (op) {
    case Op::push:
      return "push";
    case Op::pull:
      return "pull";
    case Op::copy_engine:
      return "copy_engine";
    case Op::latency:
      return "latency";
    case Op::put_signal:
      return "put_signal";
  }
  return "?";
}

char const* direction_name(Direction direction) {
  switch (direction) {
    case Direction::oneway:
      return "oneway";
    case Direction::bidir:
      return "bidir";
    case Direction::alltoall:
      return "alltoall";
  }
  return "?";
}

std::vector<Op> ops_of(transport::Kind kind) {
  if (kind == transport::Kind::lsa) return {std::begin(kAllOps), std::end(kAllOps)};
  return {Op::put_signal, Op::latency};
}

std::vector<Op> default_ops(transport::Kind kind) {
  if (kind == transport::Kind::lsa) return {Op::push, Op::pull, Op::copy_engine, Op::latency};
  return ops_of(kind);
}

bool Settings::wants(Op op) const {
  return std::find(ops.begin(), ops.end(), op) != ops.end();
}
bool Settings::wants(Direction direction) const {
  return std::find(directions.begin(), directions.end(), direction) != directions.end();
}

std::size_t parse_size(std::string const& text) {
  errno = 0;
  char* end = nullptr;
  unsigned long long const value = std::strtoull(text.c_str(), &end, 10);
  std::string unit(end ? end : "");
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::size_t scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  if (unit == "k" || unit == "kib") scale = std::size_t{1} << 10;
  if (unit == "m" || unit == "mib") scale = std::size_t{1} << 20;
  if (unit == "g" || unit == "gib") scale = std::size_t{1} << 30;
  FERRY_CHECK_CONFIG(errno == 0 && end != text.c_str() && scale != 0 && value > 0, "--sizes: '", text,
                     "' is not a size; write bytes or a number with KiB, MiB or GiB (e.g. 4KiB,1MiB,256MiB)");
  std::size_t const bytes = value * scale;
  // NOTE: the kernels move 16-byte vectors (and the seam's puts are multiples of 16 bytes).
  FERRY_CHECK_CONFIG(bytes % 16 == 0, "--sizes: ", text, " = ", bytes,
                     " bytes is not a multiple of 16; the kernels move 16-byte vectors");
  return bytes;
}

std::string size_text(std::size_t bytes) {
  if (bytes >= (std::size_t{1} << 30) && bytes % (std::size_t{1} << 30) == 0)
    return std::to_string(bytes >> 30) + " GiB";
  if (bytes >= (std::size_t{1} << 20) && bytes % (std::size_t{1} << 20) == 0)
    return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (std::size_t{1} << 10) && bytes % (std::size_t{1} << 10) == 0)
    return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  std::size_t const n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string emulated_text(transport::EmulatedOptions const& options) {
  std::string const delay = options.max_delay_ns == 0
                                ? std::string("no delay")
                                : detail::concat("seeded delay in [0, ", options.max_delay_ns, ") ns per delivery");
  return detail::concat(
      delay, ", ",
      options.reorder ? "puts and their 16-byte pieces delivered in a seeded order" : "puts delivered in issue order",
      ", seed ", options.seed, " (rank r: ", options.seed, " ^ r)");
}

Options make_options() {
  transport::EmulatedOptions const emulated;
  return Options(
      "p2p",
      "NVLink bandwidth between rank 0 and rank 1 (kernel push = 16-byte stores into the peer's memory, kernel pull = "
      "16-byte loads from it, copy engine = cudaMemcpyAsync to the peer's address) and the one-way latency of a flag; "
      "or, with --transport emulated or gin, the same pair through the transport seam (put_signal = each CTA puts its "
      "piece with a signal, the receiver's CTA waits for it; latency = a signal ping-pong).\n"
      "GB/s is 1e9 bytes per second moved in one direction: bytes / time of the slowest sending rank (put_signal: of "
      "the slowest rank, the receiver's wait included). oneway: only rank 0 sends; bidir: ranks 0 and 1 send at once, "
      "the table shows the per-direction figure and the sum of both directions (JSON: gbps per direction, gbps_sum); "
      "alltoall: every rank sends the size to every other rank at once (push, pull or put_signal; CTAs dealt over the "
      "peers), the figure is what one GPU sends / time and the sum what it sends and receives (the ceiling of an "
      "expert-parallel leg at this world). Latency = median over samples of (round-trip time / 2). Time = median of "
      "CUDA-event timings after warm-up; ranks meet in a device barrier before every timed run. Needs 2 GPUs; starts "
      "one process per GPU itself (or runs as one rank under torchrun); --one-gpu runs the emulated transport's ranks "
      "as virtual ranks of one process on one GPU.\n"
      "Emulated figures are the network's semantics between ranks that share memory (seeded delays, reordered "
      "deliveries, the leader thread of each CTA copying): they time the protocol, never a network.",
      {
          {"transport", "lsa",
           "lsa (NVLink load/store through LSA pointers), emulated (the network's semantics between ranks that share "
           "memory; not network figures), gin (NCCL GIN through the communicator: FERRY_NETWORK=gin)"},
          {"sizes", "4KiB,1MiB,64MiB,256MiB", "message sizes (bytes, or with KiB/MiB/GiB; multiples of 16)"},
          {"ctas", "8,16,32,132",
           detail::concat(
               "CTA counts of the kernel ops (a count that leaves whole CTAs idle at a size is skipped there; "
               "put_signal: at most ",
               kMaxSeamCtas, ")")},
          {"threads", "512", "threads per CTA of the kernel ops"},
          {"unroll", "0", "16-byte loads in flight per thread before its stores: 4 or 8; 0 = push 4, pull 8"},
          {"ops", "",
           detail::concat("what to measure; unset: lsa ", op_names(default_ops(transport::Kind::lsa), ","),
                          ", emulated and gin ", op_names(default_ops(transport::Kind::gin), ","), " (lsa also takes ",
                          op_name(Op::put_signal), ")")},
          {"directions", "oneway,bidir",
           "oneway (rank 0 sends), bidir (ranks 0 and 1 send at once), alltoall (every rank to every other, at once)"},
          {"warmup", "5", "untimed runs before each measurement"},
          {"iters", "20", "timed runs per measurement (the median is reported); latency samples"},
          {"latency-rounds", "1000", "round trips per latency sample (after 100 untimed ones)"},
          {"nproc", "2",
           detail::concat(
               "ranks to start when run by hand (one per GPU; ranks past 1 join the pair measures' barriers only); "
               "--one-gpu: virtual ranks, 2 to ",
               kMaxVirtualRanks)},
          {"one-gpu", "",
           "emulated: run the --nproc ranks as virtual ranks of this one process on GPU 0 (one GPU's memory, no "
           "NVLink: the figures say so)",
           true},
          {"emulated-delay-ns", std::to_string(emulated.max_delay_ns),
           "emulated: each delivery (a signal's puts) waits a seeded time in [0, V) ns; 0: none"},
          {"emulated-seed", std::to_string(emulated.seed),
           "emulated: seed of the delays and delivery orders (rank r uses seed ^ r)"},
          {"emulated-reorder", emulated.reorder ? "1" : "0",
           "emulated: 1 delivers puts and their 16-byte pieces in a seeded order, 0 in issue order"},
          {"json", "", "write the records to this file (the result-file format of docs/design.md)"},
      });
}

Settings settings_from(Options const& options) {
  Settings s;
  s.transport = transport_of(options.str("transport"));
  bool const lsa = s.transport == transport::Kind::lsa;
  for (auto const& item : split_list(options.str("sizes"))) s.sizes.push_back(parse_size(item));
  FERRY_CHECK_CONFIG(!s.sizes.empty(), "--sizes is empty; give at least one size, e.g. 256MiB");
  s.ctas = options.int_list("ctas");
  for (int c : s.ctas) FERRY_CHECK_CONFIG(c >= 1 && c <= 65535, "--ctas: ", c, " is outside [1, 65535]");
  s.threads = options.integer("threads");
  FERRY_CHECK_CONFIG(s.threads >= 32 && s.threads <= 1024 && s.threads % 32 == 0, "--threads ", s.threads,
                     " must be a multiple of 32 in [32, 1024]");
  s.unroll = options.integer("unroll");
  FERRY_CHECK_CONFIG(s.unroll == 0 || s.unroll == 4 || s.unroll == 8, "--unroll ", s.unroll, " must be 0, 4 or 8");
  if (options.str("ops").empty())
    s.ops = default_ops(s.transport);
  else
    for (auto const& item : split_list(options.str("ops"))) s.ops.push_back(op_of(item, s.transport));
  FERRY_CHECK_CONFIG(!s.ops.empty(), "--ops is empty; use ", op_names(ops_of(s.transport), ", "));
  if (s.wants(Op::put_signal))
    for (int c : s.ctas)
      FERRY_CHECK_CONFIG(c <= kMaxSeamCtas, "--ctas: ", c, " is above ", kMaxSeamCtas, ", the most CTAs of a ",
                         op_name(Op::put_signal), " measure (one endpoint and one counter each)");
  for (auto const& item : split_list(options.str("directions"))) s.directions.push_back(direction_of(item));
  FERRY_CHECK_CONFIG(!s.directions.empty(), "--directions is empty; use ", names(kAllDirections, direction_name));
  s.warmup = options.integer("warmup");
  s.iters = options.integer("iters");
  s.latency_rounds = options.integer("latency-rounds");
  FERRY_CHECK_CONFIG(s.warmup >= 0 && s.iters >= 1 && s.latency_rounds >= 1,
                     "--warmup must be >= 0, --iters and --latency-rounds >= 1");
  s.nproc = options.integer("nproc");
  s.one_gpu = options.flag("one-gpu");
  // NOTE: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the one-GPU ranks have no communicator:
  // only the emulated transport, which needs none, runs on them; and lsa there would time copies inside one GPU.
  FERRY_CHECK_CONFIG(!s.one_gpu || s.transport == transport::Kind::emulated,
                     "--one-gpu runs --transport emulated "
                     "only, not ",
                     transport::kind_name(s.transport), ": ",
                     lsa ? "lsa on one GPU would time copies inside its memory, not NVLink"
                         : "gin needs a communicator per rank, and NCCL allows one rank per GPU");
  if (s.one_gpu)
    FERRY_CHECK_CONFIG(s.nproc >= 2 && s.nproc <= kMaxVirtualRanks, "--nproc ", s.nproc, " with --one-gpu: run 2 to ",
                       kMaxVirtualRanks, " virtual ranks");
  s.emulated = emulated_from(options, s.transport);
  s.json = options.str("json");
  return s;
}

util::ResultRecord result_record(Record const& r, Settings const& s, int world) {
  util::ResultRecord rec;
  rec.add("op", op_name(r.op)).add("bytes", static_cast<int64_t>(r.bytes)).add("ctas", r.ctas);
  rec.add("direction", direction_name(r.direction));
  rec.add("transport", transport::kind_name(s.transport)).add("one_gpu", s.one_gpu);
  if (s.transport == transport::Kind::emulated) {
    rec.add("emulated_delay_ns", static_cast<int64_t>(s.emulated.max_delay_ns));
    rec.add("emulated_reorder", s.emulated.reorder).add("emulated_seed", static_cast<int64_t>(s.emulated.seed));
  }
  if (r.op == Op::latency) return rec.add("latency_us", r.latency_us);
  rec.add("gbps", r.gbps);
  if (r.direction != Direction::oneway) rec.add("gbps_sum", 2 * r.gbps);
  if (r.direction == Direction::alltoall) rec.add("peers", world - 1);
  rec.add("median_us", r.median_us);
  return rec;
}

}  // namespace ferry::cli::p2p
