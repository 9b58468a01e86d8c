// ferry p2p's options, their checks and its result records: host code without CUDA, so that the unit tests (CI has
// no GPU) run them (tests/unit/test_p2p_cli.cpp). The measures themselves are p2p.cu (NVLink load/store, the copy
// engine) and p2p_seam.cu (the transport seam's put_signal and signal round trip, over lsa, emulated or gin).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/transport/transport.hpp"
#include "options.hpp"
#include "core/util/result_file.hpp"

namespace ferry::cli::p2p {

enum class Op {
  push,         // kernel stores into the peer's window (lsa)
  pull,         // kernel loads from the peer's window (lsa)
  copy_engine,  // cudaMemcpyAsync to the peer's address (lsa)
  latency,      // lsa: a flag's ping-pong; emulated, gin: a signal's, through the seam
  put_signal,   // the seam's put with signal, and the receiver's bounded wait (any transport)
};
enum class Direction { oneway, bidir, alltoall };

char const* op_name(Op op);
char const* direction_name(Direction direction);

// What a transport can measure, and what it measures when --ops is not given (lsa: today's four NVLink figures).
std::vector<Op> ops_of(transport::Kind kind);
std::vector<Op> default_ops(transport::Kind kind);

// NOTE: a put_signal measure gives every CTA its own endpoint (an emulated endpoint's state is ~35 KiB) and its own
// counter (over gin a GIN signal, of the communicator's kGinSignals): 512 keeps both small.
inline constexpr int kMaxSeamCtas = 512;
// Virtual ranks of --one-gpu: each is a grid of its own CTAs on the one GPU, all of them co-resident.
inline constexpr int kMaxVirtualRanks = 8;

struct Settings {
  transport::Kind transport = transport::Kind::lsa;
  std::vector<std::size_t> sizes;
  std::vector<int> ctas;
  int threads = 512;
  int unroll = 0;
  std::vector<Op> ops;
  std::vector<Direction> directions;
  int warmup = 5;
  int iters = 20;
  int latency_rounds = 1000;
  int nproc = 2;
  bool one_gpu = false;                 // every rank a virtual rank of this process, on GPU 0 (emulated only)
  transport::EmulatedOptions emulated;  // --transport emulated
  std::string json;

  bool wants(Op op) const;
  bool wants(Direction direction) const;
};

Options make_options();
// Every option's value checked, each refusal a ConfigError naming the option, the value and what is allowed.
Settings settings_from(Options const& options);

// "4KiB", "4K", "1MiB", "1G", "4096" -> bytes (binary units; a multiple of 16).
std::size_t parse_size(std::string const& text);
std::string size_text(std::size_t bytes);

// The median of timings (the mean of the middle two for an even count).
double median(std::vector<double> values);

// The emulated transport's settings as printed above the table: "seeded delay in [0, 20000) ns per delivery, puts
// and their 16-byte pieces reordered, seed 1 (rank r: 1 ^ r)".
std::string emulated_text(transport::EmulatedOptions const& options);

struct Record {
  Op op;
  Direction direction;
  std::size_t bytes = 0;
  int ctas = 0;
  double median_us = 0;
  double gbps = 0;        // per direction (alltoall: what one GPU sends to all its peers / time)
  double latency_us = 0;  // latency only
};

// One record of the result file (docs/design.md, "Result files"): op, bytes, ctas, direction, transport, one_gpu,
// the emulated transport's settings where it ran, then latency_us or gbps (gbps_sum, peers) and median_us.
util::ResultRecord result_record(Record const& record, Settings const& settings, int world);

}  // namespace ferry::cli::p2p
