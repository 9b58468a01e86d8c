// ferry p2p: NVLink bandwidth of kernel stores (push) and loads (pull) between two GPUs through NCCL LSA pointers,
// next to the copy engine on the same buffers, and the one-way latency of a flag; and the all-to-all, every rank
// pushing to (or pulling from) every other at once, the ceiling of expert parallelism's legs. The pair measures run
// on ranks 0 and 1 (any further rank takes part in the barriers only); the all-to-all on every rank.
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "build_info.hpp"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "commands.hpp"
#include "core/cuda_check.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/error.hpp"
#include "options.hpp"
#include "ranks.hpp"
#include "util/result_file.hpp"

namespace ferry::cli {
namespace {

// ---- kernels ------------------------------------------------------------------------------------------------------

struct CopyParams {
  void const* src;
  void* dst;
  std::size_t bytes;
};

// Grid-strided 16-byte copy: at every step the grid covers one contiguous span, so each warp's accesses coalesce.
// Push reads local input that nothing writes meanwhile (non-coherent path) and stores to the peer; pull loads from
// the peer (coherent path) and needs more loads in flight to cover the NVLink round trip.
template <bool kPull, int kUnroll>
__global__ void copy_kernel(CopyParams const params) {
  static_assert(kUnroll == 4 || kUnroll == 8, "copy_kernel: kUnroll must be 4 or 8 (see --unroll)");
  int const lane = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  int const stride = static_cast<int>(gridDim.x * blockDim.x);
  device::copy_16B<!kPull, kUnroll>(params.dst, params.src, params.bytes, lane, stride);
}

// The all-to-all: pair g of this rank is peer (rank + 1 + g) % world; the grid's CTAs are dealt over the pairs.
struct AllToAllParams {
  void* dst[kMaxLocalPeers];
  void const* src[kMaxLocalPeers];
  int pairs;
  std::size_t bytes;  // per pair
};

template <bool kPull, int kUnroll>
__global__ void alltoall_kernel(AllToAllParams const params) {
  device::copy_16B_dealt<!kPull, kUnroll>(params.dst, params.src, params.pairs, params.bytes);
}

struct PingPongParams {
  DeviceView view;
  uint64_t* peer_flag;       // the flag word in the peer's memory
  uint64_t const* own_flag;  // our flag word, written by the peer
  uint64_t base;             // values of this launch are base+1 .. base+warmup+rounds (flags only grow)
  int warmup;
  int rounds;
  int peer;
  bool initiator;
  uint64_t* elapsed_ns;  // device word: time of the timed rounds
};

// One thread: rank 0 sets the peer's flag and waits for its own, rank 1 waits and answers. Writes go to the peer,
// polls stay local, so a round trip is two NVLink writes. Flags carry no data, hence relaxed stores.
__global__ void ping_pong_kernel(PingPongParams const params) {
  uint64_t start = device::arch::global_timer_ns();
  for (int i = 0; i < params.warmup + params.rounds; ++i) {
    if (i == params.warmup) start = device::arch::global_timer_ns();
    uint64_t const value = params.base + static_cast<uint64_t>(i) + 1;
    if (params.initiator) {
      device::flag_set_relaxed(params.peer_flag, value);
      if (!device::wait_signal_geq(params.view, params.own_flag, value, params.peer, WaitPhase::test)) return;
    } else {
      if (!device::wait_signal_geq(params.view, params.own_flag, value, params.peer, WaitPhase::test)) return;
      device::flag_set_relaxed(params.peer_flag, value);
    }
  }
  *params.elapsed_ns = device::arch::global_timer_ns() - start;
}

// ---- options ------------------------------------------------------------------------------------------------------

enum class Op { push, pull, copy_engine, latency };
enum class Direction { oneway, bidir, alltoall };

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

std::vector<std::string> split_list(std::string const& text) {
  std::vector<std::string> out;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) out.push_back(item);
  return out;
}

// "4KiB", "4K", "1MiB", "1G", "4096" -> bytes (binary units).
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
  // NOTE: the kernels move 16-byte vectors.
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

Options make_options() {
  return Options(
      "p2p",
      "NVLink bandwidth between rank 0 and rank 1 (kernel push = 16-byte stores into the peer's memory, kernel pull = "
      "16-byte loads from it, copy engine = cudaMemcpyAsync to the peer's address) and the one-way latency of a flag.\n"
      "GB/s is 1e9 bytes per second moved in one direction: bytes / time of the slowest sending rank. oneway: only "
      "rank 0 sends; bidir: ranks 0 and 1 send at once, the table shows the per-direction figure and the sum of both "
      "directions (JSON: gbps per direction, gbps_sum); alltoall: every rank sends the size to every other rank at "
      "once (push or pull; CTAs dealt over the peers), the figure is what one GPU sends / time and the sum what it "
      "sends and receives (the ceiling of an expert-parallel leg at this world). Latency = median over samples of "
      "(round-trip time / 2) of a flag ping-pong. Time = median of CUDA-event timings after warm-up; ranks meet in a "
      "device barrier before every timed run. Needs 2 GPUs; starts one process per GPU itself (or runs as one rank "
      "under torchrun).",
      {
          {"sizes", "4KiB,1MiB,64MiB,256MiB", "message sizes (bytes, or with KiB/MiB/GiB; multiples of 16)"},
          {"ctas", "8,16,32,132",
           "CTA counts of the kernel ops (a count that leaves whole CTAs idle at a size is skipped there)"},
          {"threads", "512", "threads per CTA of the kernel ops"},
          {"unroll", "0", "16-byte loads in flight per thread before its stores: 4 or 8; 0 = push 4, pull 8"},
          {"ops", "push,pull,copy_engine,latency", "what to measure: push, pull, copy_engine, latency"},
          {"directions", "oneway,bidir",
           "oneway (rank 0 sends), bidir (ranks 0 and 1 send at once), alltoall (every rank to every other, at once)"},
          {"warmup", "5", "untimed runs before each measurement"},
          {"iters", "20", "timed runs per measurement (the median is reported); latency samples"},
          {"latency-rounds", "1000", "round trips per latency sample (after 100 untimed ones)"},
          {"nproc", "2",
           "ranks to start when run by hand (one per GPU; ranks past 1 join the pair measures' barriers only)"},
          {"json", "", "write the records to this file (the result-file format of docs/design.md)"},
      });
}

struct Settings {
  std::vector<std::size_t> sizes;
  std::vector<int> ctas;
  int threads = 512;
  int unroll = 0;
  std::vector<Op> ops;
  std::vector<Direction> directions;
  int warmup = 5;
  int iters = 20;
  int latency_rounds = 1000;
  std::string json;
};

Settings settings_from(Options const& options) {
  Settings s;
  for (auto const& item : split_list(options.str("sizes"))) s.sizes.push_back(parse_size(item));
  FERRY_CHECK_CONFIG(!s.sizes.empty(), "--sizes is empty; give at least one size, e.g. 256MiB");
  s.ctas = options.int_list("ctas");
  for (int c : s.ctas) FERRY_CHECK_CONFIG(c >= 1 && c <= 65535, "--ctas: ", c, " is outside [1, 65535]");
  s.threads = options.integer("threads");
  FERRY_CHECK_CONFIG(s.threads >= 32 && s.threads <= 1024 && s.threads % 32 == 0, "--threads ", s.threads,
                     " must be a multiple of 32 in [32, 1024]");
  s.unroll = options.integer("unroll");
  FERRY_CHECK_CONFIG(s.unroll == 0 || s.unroll == 4 || s.unroll == 8, "--unroll ", s.unroll, " must be 0, 4 or 8");
  for (auto const& item : split_list(options.str("ops"))) {
    if (item == "push")
      s.ops.push_back(Op::push);
    else if (item == "pull")
      s.ops.push_back(Op::pull);
    else if (item == "copy_engine")
      s.ops.push_back(Op::copy_engine);
    else if (item == "latency")
      s.ops.push_back(Op::latency);
    else
      FERRY_THROW(ConfigError, "config", "--ops: '", item, "' is unknown; use push, pull, copy_engine, latency");
  }
  for (auto const& item : split_list(options.str("directions"))) {
    if (item == "oneway")
      s.directions.push_back(Direction::oneway);
    else if (item == "bidir")
      s.directions.push_back(Direction::bidir);
    else if (item == "alltoall")
      s.directions.push_back(Direction::alltoall);
    else
      FERRY_THROW(ConfigError, "config", "--directions: '", item, "' is unknown; use oneway, bidir, alltoall");
  }
  s.warmup = options.integer("warmup");
  s.iters = options.integer("iters");
  s.latency_rounds = options.integer("latency-rounds");
  FERRY_CHECK_CONFIG(s.warmup >= 0 && s.iters >= 1 && s.latency_rounds >= 1,
                     "--warmup must be >= 0, --iters and --latency-rounds >= 1");
  s.json = options.str("json");
  return s;
}

// ---- measurement --------------------------------------------------------------------------------------------------

struct Record {
  Op op;
  Direction direction;
  std::size_t bytes = 0;
  int ctas = 0;
  double median_us = 0;
  double gbps = 0;        // per direction (alltoall: what one GPU sends to all its peers / time)
  double latency_us = 0;  // latency only
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  std::size_t const n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

class P2p {
 public:
  P2p(Communicator& comm, Settings const& settings) : comm_(comm), s_(settings) {
    rank_ = comm.rank();
    peer_ = rank_ == 0 ? 1 : 0;
    FERRY_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    max_bytes_ = *std::max_element(s_.sizes.begin(), s_.sizes.end());
    // the all-to-all: a slice of the window per source rank, a slice of local memory per pulled peer
    bool const alltoall =
        std::find(s_.directions.begin(), s_.directions.end(), Direction::alltoall) != s_.directions.end();
    std::size_t const local_bytes = alltoall ? max_bytes_ * std::max(1, comm.world() - 1) : max_bytes_;
    FERRY_CHECK_CUDA(cudaMalloc(&local_, local_bytes));
    FERRY_CHECK_CUDA(cudaMemset(local_, 0x5a, local_bytes));
    window_ = comm.alloc_symmetric(alltoall ? max_bytes_ * comm.world() : max_bytes_);
    flags_ = comm.alloc_symmetric(sizeof(uint64_t));
    FERRY_CHECK_CUDA(cudaMalloc(&elapsed_, sizeof(uint64_t)));
    int const num_events = s_.warmup + s_.iters;
    events_.resize(2 * num_events);
    for (auto& event : events_) FERRY_CHECK_CUDA(cudaEventCreate(&event));
    FERRY_CHECK_CUDA(cudaDeviceSynchronize());
  }

  ~P2p() {
    // Best effort: the communicator's teardown reports anything serious.
    for (auto event : events_) cudaEventDestroy(event);
    if (elapsed_) cudaFree(elapsed_);
    if (local_) cudaFree(local_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // Median time in microseconds of the slowest sending rank (0 if no rank sends).
  double time_transfer(Op op, Direction direction, std::size_t bytes, int ctas) {
    bool const sends = rank_ == 0 || (rank_ == 1 && direction == Direction::bidir) || direction == Direction::alltoall;
    int const runs = s_.warmup + s_.iters;
    for (int i = 0; i < runs; ++i) {
      // 1. meet the peer on the device (no host round trip), then time the transfer alone
      comm_.barrier(stream_);
      FERRY_CHECK_CUDA(cudaEventRecord(events_[2 * i], stream_));
      if (sends) {
        if (direction == Direction::alltoall)
          enqueue_alltoall(op, bytes, ctas);
        else
          enqueue(op, bytes, ctas);
      }
      FERRY_CHECK_CUDA(cudaEventRecord(events_[2 * i + 1], stream_));
    }
    comm_.check_errors(stream_);
    double mine = 0;
    if (sends) {
      std::vector<double> times;
      for (int i = s_.warmup; i < runs; ++i) {
        float ms = 0;
        FERRY_CHECK_CUDA(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]));
        times.push_back(1e3 * ms);
      }
      mine = median(times);
    }
    // 2. a transfer is as slow as its slowest sender
    std::vector<double> all(comm_.world());
    comm_.bootstrap().allgather(&mine, all.data(), sizeof(double));
    return *std::max_element(all.begin(), all.end());
  }

  // Median one-way latency in microseconds (round trip / 2) measured on rank 0.
  double time_latency() {
    constexpr int kWarmupRounds = 100;
    auto* own = reinterpret_cast<uint64_t*>(flags_.view.ptr[rank_]);
    auto* peer = reinterpret_cast<uint64_t*>(flags_.view.ptr[peer_]);
    std::vector<double> samples;
    for (int i = 0; i < s_.iters; ++i) {
      comm_.barrier(stream_);
      if (rank_ <= 1) {
        PingPongParams params{comm_.device_view(), peer,  own,        flag_base_, kWarmupRounds,
                              s_.latency_rounds,   peer_, rank_ == 0, elapsed_};
        ping_pong_kernel<<<1, 1, 0, stream_>>>(params);
        FERRY_CHECK_CUDA(cudaGetLastError());
      }
      flag_base_ += kWarmupRounds + s_.latency_rounds;
      comm_.check_errors(stream_);
      uint64_t elapsed = 0;
      FERRY_CHECK_CUDA(cudaMemcpy(&elapsed, elapsed_, sizeof(elapsed), cudaMemcpyDeviceToHost));
      samples.push_back(1e-3 * static_cast<double>(elapsed) / s_.latency_rounds / 2);
    }
    double result = rank_ == 0 ? median(samples) : 0;
    comm_.bootstrap().broadcast(&result, sizeof(result), 0);
    return result;
  }

 private:
  // Every peer at once: push stores into the peer's slice for this rank, pull loads the slice the peer holds for it.
  void enqueue_alltoall(Op op, std::size_t bytes, int ctas) {
    int const world = comm_.world();
    AllToAllParams params{};
    params.pairs = world - 1;
    params.bytes = bytes;
    for (int g = 0; g < params.pairs; ++g) {
      int const peer = (rank_ + 1 + g) % world;
      char* const slice = static_cast<char*>(window_.view.ptr[peer]) + static_cast<std::size_t>(rank_) * bytes;
      if (op == Op::push) {
        params.src[g] = local_;
        params.dst[g] = slice;
      } else {
        params.src[g] = slice;
        params.dst[g] = static_cast<char*>(local_) + static_cast<std::size_t>(g) * bytes;
      }
    }
    int const unroll = s_.unroll != 0 ? s_.unroll : (op == Op::pull ? 8 : 4);
    if (op == Op::push)
      unroll == 8 ? alltoall_kernel<false, 8><<<ctas, s_.threads, 0, stream_>>>(params)
                  : alltoall_kernel<false, 4><<<ctas, s_.threads, 0, stream_>>>(params);
    else
      unroll == 8 ? alltoall_kernel<true, 8><<<ctas, s_.threads, 0, stream_>>>(params)
                  : alltoall_kernel<true, 4><<<ctas, s_.threads, 0, stream_>>>(params);
    FERRY_CHECK_CUDA(cudaGetLastError());
  }

  void enqueue(Op op, std::size_t bytes, int ctas) {
    void* peer_window = window_.view.ptr[peer_];
    // Pull waits a full NVLink round trip per load, so it wants more loads in flight than push by default.
    int const unroll = s_.unroll != 0 ? s_.unroll : (op == Op::pull ? 8 : 4);
    switch (op) {
      case Op::push:
        if (unroll == 8)
          copy_kernel<false, 8><<<ctas, s_.threads, 0, stream_>>>(CopyParams{local_, peer_window, bytes});
        else
          copy_kernel<false, 4><<<ctas, s_.threads, 0, stream_>>>(CopyParams{local_, peer_window, bytes});
        break;
      case Op::pull:
        if (unroll == 8)
          copy_kernel<true, 8><<<ctas, s_.threads, 0, stream_>>>(CopyParams{peer_window, local_, bytes});
        else
          copy_kernel<true, 4><<<ctas, s_.threads, 0, stream_>>>(CopyParams{peer_window, local_, bytes});
        break;
      case Op::copy_engine:
        FERRY_CHECK_CUDA(cudaMemcpyAsync(peer_window, local_, bytes, cudaMemcpyDeviceToDevice, stream_));
        break;
      case Op::latency:
        break;
    }
    FERRY_CHECK_CUDA(cudaGetLastError());
  }

  Communicator& comm_;
  Settings const& s_;
  int rank_ = 0;
  int peer_ = 1;
  cudaStream_t stream_ = nullptr;
  std::size_t max_bytes_ = 0;
  void* local_ = nullptr;
  SymmetricRegion window_{};
  SymmetricRegion flags_{};
  uint64_t* elapsed_ = nullptr;
  uint64_t flag_base_ = 0;
  std::vector<cudaEvent_t> events_;
};

// ---- output -------------------------------------------------------------------------------------------------------

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

void write_json(std::string const& path, std::string const& device, int world, std::vector<Record> const& records) {
  std::vector<util::ResultRecord> out;
  for (Record const& r : records) {
    util::ResultRecord& rec = out.emplace_back();
    rec.add("op", op_name(r.op)).add("bytes", static_cast<int64_t>(r.bytes)).add("ctas", r.ctas);
    rec.add("direction", direction_name(r.direction));
    if (r.op == Op::latency) {
      rec.add("latency_us", r.latency_us);
      continue;
    }
    rec.add("gbps", r.gbps);
    if (r.direction != Direction::oneway) rec.add("gbps_sum", 2 * r.gbps);
    if (r.direction == Direction::alltoall) rec.add("peers", world - 1);
    rec.add("median_us", r.median_us);
  }
  util::write_result_file(path, {"ferry p2p", git_commit(), device, world}, out);
}

// "  362.1 /  724.2" for bidir and alltoall, "  362.1" for oneway.
std::string gbps_cell(double gbps, Direction direction) {
  char text[48];
  if (direction != Direction::oneway)
    std::snprintf(text, sizeof(text), "%7.1f / %7.1f", gbps, 2 * gbps);
  else
    std::snprintf(text, sizeof(text), "%7.1f          ", gbps);
  return text;
}

int run_p2p(Options const& options) {
  Settings const s = settings_from(options);
  auto comm = Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()),
                                   CommunicatorOptions{Backend::cuda, -1});
  FERRY_CHECK_CONFIG(comm->world() >= 2, "ferry p2p needs 2 ranks (one per GPU), got world=", comm->world(),
                     "; run it on a host with 2 or more GPUs, or pass --nproc 2");
  bool const printer = comm->rank() == 0;
  cudaDeviceProp props{};
  FERRY_CHECK_CUDA(cudaGetDeviceProperties(&props, comm->device()));
  std::string const device = props.name;

  std::vector<Record> records;
  {
    P2p p2p(*comm, s);
    bool const want_ce = std::find(s.ops.begin(), s.ops.end(), Op::copy_engine) != s.ops.end();
    if (printer) {
      std::printf(
          "ferry p2p: %d x %s, ranks 0 <-> 1 (alltoall: every rank), %d threads/CTA, warmup %d, iters %d "
          "(median)\n",
          comm->world(), device.c_str(), s.threads, s.warmup, s.iters);
      std::printf(
          "GB/s = 1e9 bytes/s in one direction; bidir shows per direction / sum of both; alltoall what one GPU sends "
          "(bytes = to each of its %d peers) / sent + received. CE = copy engine.\n\n",
          comm->world() - 1);
      std::printf("%-11s %-9s %10s %5s %17s %17s %9s\n", "op", "direction", "bytes", "ctas", "GB/s (dir / sum)",
                  "CE GB/s", "kernel/CE");
    }
    for (std::size_t bytes : s.sizes) {
      for (Direction direction : s.directions) {
        // 1. the copy engine on the same buffers: the reference every kernel figure is printed against
        double ce_gbps = 0;
        bool const alltoall = direction == Direction::alltoall;
        int const pairs = alltoall ? comm->world() - 1 : 1;
        if (want_ce && !alltoall) {  // NOTE: an all-to-all of copies would need a stream per peer: not measured
          double const us = p2p.time_transfer(Op::copy_engine, direction, bytes, 0);
          ce_gbps = bytes / (us * 1e-6) / 1e9;
          records.push_back({Op::copy_engine, direction, bytes, 0, us, ce_gbps, 0});
          if (printer)
            std::printf("%-11s %-9s %10s %5s %17s %17s %9s\n", "copy_engine", direction_name(direction),
                        size_text(bytes).c_str(), "-", gbps_cell(ce_gbps, direction).c_str(), "", "");
        }
        // 2. kernel push / pull over the CTA sweep
        for (Op op : s.ops) {
          if (op != Op::push && op != Op::pull) continue;
          for (std::size_t i = 0; i < s.ctas.size(); ++i) {
            int const ctas = s.ctas[i];
            // NOTE: skip counts that leave whole CTAs without a vector to move (they time the same kernel again).
            std::size_t const vectors = bytes / 16;
            if (ctas < pairs) continue;  // alltoall: at least one CTA per peer
            if (i > 0 && static_cast<std::size_t>(ctas / pairs - 1) * s.threads >= vectors) continue;
            double const us = p2p.time_transfer(op, direction, bytes, ctas);
            double const gbps = static_cast<double>(bytes) * pairs / (us * 1e-6) / 1e9;
            records.push_back({op, direction, bytes, ctas, us, gbps, 0});
            if (printer)
              std::printf("%-11s %-9s %10s %5d %17s %17s %9s\n", op_name(op), direction_name(direction),
                          size_text(bytes).c_str(), ctas, gbps_cell(gbps, direction).c_str(),
                          want_ce && !alltoall ? gbps_cell(ce_gbps, direction).c_str() : "",
                          want_ce && !alltoall ? fixed(gbps / ce_gbps, 2).c_str() : "");
          }
        }
      }
      if (printer) std::fflush(stdout);
    }
    // 3. one-way latency of a flag
    if (std::find(s.ops.begin(), s.ops.end(), Op::latency) != s.ops.end()) {
      double const us = p2p.time_latency();
      records.push_back({Op::latency, Direction::oneway, sizeof(uint64_t), 1, 0, 0, us});
      if (printer)
        std::printf("\nlatency: one-way flag %.3f us (round trip / 2, %d round trips per sample, median of %d)\n", us,
                    s.latency_rounds, s.iters);
    }
  }
  if (printer && !s.json.empty()) {
    write_json(s.json, device, comm->world(), records);
    std::printf("wrote %s\n", s.json.c_str());
  }
  return 0;
}

}  // namespace

int p2p_main(int argc, char** argv) {
  Options options = make_options();
  if (!options.parse(argc, argv)) return 0;  // --help printed
  if (is_rank_process()) return run_rank("p2p", [&] { return run_p2p(options); });
  // a bad option is one error here, not one per rank; the result file is checked before any rank measures
  util::check_result_path(settings_from(options).json, "--json");
  int const nproc = options.integer("nproc");
  int const gpus = cuda_device_count();
  FERRY_CHECK_CONFIG(nproc >= 2, "--nproc ", nproc, ": ferry p2p needs 2 ranks");
  FERRY_CHECK_CONFIG(gpus >= nproc, "ferry p2p needs ", nproc, " GPUs (one per rank) but this host shows ", gpus,
                     "; run it on a machine with 2 or more GPUs (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  return launch_self("p2p", argc, argv, nproc);
}

}  // namespace ferry::cli
