// ferry p2p: NVLink bandwidth of kernel stores (push) and loads (pull) between two GPUs through NCCL LSA pointers,
// next to the copy engine on the same buffers, and the one-way latency of a flag; and the all-to-all, every rank
// pushing to (or pulling from) every other at once, the ceiling of expert parallelism's legs. The pair measures run
// on ranks 0 and 1 (any further rank takes part in the barriers only); the all-to-all on every rank. Over the
// emulated and gin transports (and as put_signal over lsa) the same sweep goes through the transport seam
// (p2p_seam.cu); its options and records are p2p_settings.cpp's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "build_info.hpp"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "commands.hpp"
#include "core/cuda_check.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "options.hpp"
#include "p2p_seam.hpp"
#include "p2p_settings.hpp"
#include "p2p_timing.cuh"
#include "ranks.hpp"
#include "core/util/result_file.hpp"

namespace ferry::cli {
namespace {

using namespace p2p;  // NOLINT: the p2p command's own names (p2p_settings.hpp)

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
  void* dst[kMaxLsaTeam];
  void const* src[kMaxLsaTeam];
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

// ---- measurement --------------------------------------------------------------------------------------------------

class P2p {
 public:
  P2p(Communicator& comm, Settings const& settings)
      : comm_(comm), s_(settings), runs_(settings.warmup, settings.iters) {
    rank_ = comm.rank();
    peer_ = rank_ == 0 ? 1 : 0;
    FERRY_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    max_bytes_ = *std::max_element(s_.sizes.begin(), s_.sizes.end());
    // the all-to-all: a slice of the window per source rank, a slice of local memory per pulled peer
    bool const alltoall = s_.wants(Direction::alltoall);
    std::size_t const local_bytes = alltoall ? max_bytes_ * std::max(1, comm.world() - 1) : max_bytes_;
    FERRY_CHECK_CUDA(cudaMalloc(&local_, local_bytes));
    FERRY_CHECK_CUDA(cudaMemset(local_, 0x5a, local_bytes));
    window_ = comm.alloc_symmetric(alltoall ? max_bytes_ * comm.world() : max_bytes_);
    flags_ = comm.alloc_symmetric(sizeof(uint64_t));
    FERRY_CHECK_CUDA(cudaMalloc(&elapsed_, sizeof(uint64_t)));
    FERRY_CHECK_CUDA(cudaDeviceSynchronize());
  }

  ~P2p() {
    // Best effort: the communicator's teardown reports anything serious.
    if (elapsed_) cudaFree(elapsed_);
    if (local_) cudaFree(local_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // Median time in microseconds of the slowest sending rank (0 if no rank sends).
  double time_transfer(Op op, Direction direction, std::size_t bytes, int ctas) {
    bool const sends = rank_ == 0 || (rank_ == 1 && direction == Direction::bidir) || direction == Direction::alltoall;
    // 1. meet the peer on the device before every run, then time the transfer alone
    runs_.enqueue(
        stream_, [&] { comm_.barrier(stream_); },
        [&] {
          if (!sends) return;
          if (direction == Direction::alltoall)
            enqueue_alltoall(op, bytes, ctas);
          else
            enqueue(op, bytes, ctas);
        });
    comm_.check_errors(stream_);
    // 2. a transfer is as slow as its slowest sender
    return slowest_rank(comm_, sends ? runs_.median_us() : 0);
  }

  // Median one-way latency in microseconds (round trip / 2) measured on rank 0.
  double time_latency() {
    constexpr int kWarmupRounds = 100;
    auto* own = reinterpret_cast<uint64_t*>(flags_.view.peer(rank_));
    auto* peer = reinterpret_cast<uint64_t*>(flags_.view.peer(peer_));
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
      char* const slice = static_cast<char*>(window_.view.peer(peer)) + static_cast<std::size_t>(rank_) * bytes;
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
    void* peer_window = window_.view.peer(peer_);
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
      case Op::put_signal:  // p2p_seam.cu
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
  TimedRuns runs_;
};

// ---- output -------------------------------------------------------------------------------------------------------

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
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

// The table: lsa's columns as they have always been (its put_signal rows among them); over a network transport its
// name in every row, so that an emulated figure is never read as a network one.
class Table {
 public:
  Table(Settings const& s, bool printer) : s_(s), printer_(printer) {}

  void header(int world, std::string const& device) const {
    if (!printer_) return;
    if (!network()) {
      std::printf(
          "ferry p2p: %d x %s, ranks 0 <-> 1 (alltoall: every rank), %d threads/CTA, warmup %d, iters %d "
          "(median)\n",
          world, device.c_str(), s_.threads, s_.warmup, s_.iters);
      std::printf(
          "GB/s = 1e9 bytes/s in one direction; bidir shows per direction / sum of both; alltoall what one GPU sends "
          "(bytes = to each of its %d peers) / sent + received. CE = copy engine.\n\n",
          world - 1);
      std::printf("%-11s %-9s %10s %5s %17s %17s %9s\n", "op", "direction", "bytes", "ctas", "GB/s (dir / sum)",
                  "CE GB/s", "kernel/CE");
      return;
    }
    char const* transport = transport::kind_name(s_.transport);
    if (s_.one_gpu)
      std::printf(
          "ferry p2p: transport %s, %d virtual ranks on ONE %s (GPU 0, one process), ranks 0 <-> 1 (alltoall: "
          "every rank), %d threads/CTA, warmup %d, iters %d (median)\n",
          transport, world, device.c_str(), s_.threads, s_.warmup, s_.iters);
    else
      std::printf(
          "ferry p2p: transport %s, %d x %s, ranks 0 <-> 1 (alltoall: every rank), %d threads/CTA, warmup %d, "
          "iters %d (median)\n",
          transport, world, device.c_str(), s_.threads, s_.warmup, s_.iters);
    if (s_.transport == transport::Kind::emulated)
      std::printf(
          "EMULATED, not network figures: the network's semantics between ranks that share memory (%s), each CTA's "
          "leader thread copying its puts; they time the protocol and the emulation.%s\n",
          emulated_text(s_.emulated).c_str(),
          s_.one_gpu ? " One GPU: every window is in its memory (no NVLink, no network)." : "");
    else
      std::printf("GIN: NCCL's GPU-initiated networking, set up by the communicator (FERRY_NETWORK=gin).\n");
    std::printf(
        "put_signal: each CTA puts its piece of the bytes with a signal, the peer's CTA waits for it; time of the "
        "slowest rank, its waits included. GB/s = 1e9 bytes/s in one direction; bidir shows per direction / sum of "
        "both; alltoall what one GPU sends (bytes = to each of its %d peers) / sent + received.\n\n",
        world - 1);
    std::printf("%-11s %-9s %-9s %10s %5s %17s\n", "op", "transport", "direction", "bytes", "ctas", "GB/s (dir / sum)");
  }

  // ce_gbps: the copy engine's figure at the same size and direction (0: not measured)
  void row(Record const& r, double ce_gbps) const {
    if (!printer_) return;
    if (network()) {
      std::printf("%-11s %-9s %-9s %10s %5d %17s\n", op_name(r.op), transport::kind_name(s_.transport),
                  direction_name(r.direction), size_text(r.bytes).c_str(), r.ctas,
                  gbps_cell(r.gbps, r.direction).c_str());
    } else if (r.op == Op::copy_engine) {
      std::printf("%-11s %-9s %10s %5s %17s %17s %9s\n", "copy_engine", direction_name(r.direction),
                  size_text(r.bytes).c_str(), "-", gbps_cell(r.gbps, r.direction).c_str(), "", "");
    } else {
      bool const ce = ce_gbps > 0 && r.op != Op::put_signal;
      std::printf("%-11s %-9s %10s %5d %17s %17s %9s\n", op_name(r.op), direction_name(r.direction),
                  size_text(r.bytes).c_str(), r.ctas, gbps_cell(r.gbps, r.direction).c_str(),
                  ce ? gbps_cell(ce_gbps, r.direction).c_str() : "", ce ? fixed(r.gbps / ce_gbps, 2).c_str() : "");
    }
  }

  void not_resident(Direction direction, std::size_t bytes, int ctas, int world) const {
    if (printer_)
      std::printf("%-11s %-9s %-9s %10s %5d skipped: %d virtual ranks x %d CTAs do not fit on the GPU at once\n",
                  op_name(Op::put_signal), transport::kind_name(s_.transport), direction_name(direction),
                  size_text(bytes).c_str(), ctas, world, ctas);
  }

  void latency(double us) const {
    if (!printer_) return;
    if (!network()) {
      std::printf("\nlatency: one-way flag %.3f us (round trip / 2, %d round trips per sample, median of %d)\n", us,
                  s_.latency_rounds, s_.iters);
      return;
    }
    std::printf(
        "\nlatency: one-way signal %.3f us over %s (signal round trip through the seam / 2, %d round trips "
        "per sample, median of %d)%s\n",
        us, transport::kind_name(s_.transport), s_.latency_rounds, s_.iters,
        s_.transport == transport::Kind::emulated ? "; EMULATED: each signal waits its seeded delay, not a network's"
                                                  : "");
  }

 private:
  bool network() const { return s_.transport != transport::Kind::lsa; }
  Settings const& s_;
  bool printer_;
};

void write_json(Settings const& s, std::string const& device, int world, std::vector<Record> const& records) {
  std::vector<util::ResultRecord> out;
  for (Record const& r : records) out.push_back(result_record(r, s, world));
  util::write_result_file(s.json, {"ferry p2p", git_commit(), device, world}, out);
  std::printf("wrote %s\n", s.json.c_str());
}

// What a sweep measures with: the NVLink measures of the lsa transport (a communicator's ranks only) and the seam's.
struct Measures {
  P2p* lsa = nullptr;
  SeamMeasures* seam = nullptr;
};

// Every size x direction x op x CTA count of the settings, printed as measured (rank 0), and their records.
std::vector<Record> sweep(Settings const& s, Measures const& m, int world, std::string const& device, bool printer) {
  Table const table(s, printer);
  table.header(world, device);
  std::vector<Record> records;
  for (std::size_t bytes : s.sizes) {
    for (Direction direction : s.directions) {
      // 1. the copy engine on the same buffers: the reference every kernel figure is printed against
      double ce_gbps = 0;
      bool const alltoall = direction == Direction::alltoall;
      int const pairs = alltoall ? world - 1 : 1;
      if (s.wants(Op::copy_engine) && !alltoall) {  // NOTE: an all-to-all of copies would need a stream per peer
        double const us = m.lsa->time_transfer(Op::copy_engine, direction, bytes, 0);
        ce_gbps = bytes / (us * 1e-6) / 1e9;
        records.push_back({Op::copy_engine, direction, bytes, 0, us, ce_gbps, 0});
        table.row(records.back(), 0);
      }
      // 2. kernel push / pull and the seam's put_signal over the CTA sweep
      for (Op op : s.ops) {
        if (op != Op::push && op != Op::pull && op != Op::put_signal) continue;
        for (std::size_t i = 0; i < s.ctas.size(); ++i) {
          int const ctas = s.ctas[i];
          // NOTE: skip counts that leave whole CTAs without a vector to move (they time the same kernel again).
          std::size_t const vectors = bytes / 16;
          if (ctas < pairs) continue;  // alltoall: at least one CTA per peer
          if (i > 0 && static_cast<std::size_t>(ctas / pairs - 1) * s.threads >= vectors) continue;
          if (op == Op::put_signal && !m.seam->fits(ctas)) {
            table.not_resident(direction, bytes, ctas, world);
            continue;
          }
          double const us = op == Op::put_signal ? m.seam->time_put_signal(direction, bytes, ctas)
                                                 : m.lsa->time_transfer(op, direction, bytes, ctas);
          double const gbps = static_cast<double>(bytes) * pairs / (us * 1e-6) / 1e9;
          records.push_back({op, direction, bytes, ctas, us, gbps, 0});
          table.row(records.back(), alltoall ? 0 : ce_gbps);
        }
      }
    }
    if (printer) std::fflush(stdout);
  }
  // 3. one-way latency: a flag over lsa, a signal through the seam over a network transport
  if (s.wants(Op::latency)) {
    double const us = s.transport == transport::Kind::lsa ? m.lsa->time_latency() : m.seam->time_latency();
    records.push_back({Op::latency, Direction::oneway, sizeof(uint64_t), 1, 0, 0, us});
    table.latency(us);
  }
  return records;
}

std::string device_name(int device) {
  cudaDeviceProp props{};
  FERRY_CHECK_CUDA(cudaGetDeviceProperties(&props, device));
  return props.name;
}

// --transport gin sets GIN up through the communicator (FERRY_NETWORK=gin), unless the environment chose otherwise.
void ask_for_gin() {
  std::string const network = env_string("FERRY_NETWORK");
  FERRY_CHECK_CONFIG(network == "auto" || network == "gin",
                     "--transport gin needs GIN from the communicator, but FERRY_NETWORK=", network,
                     " leaves it out; unset FERRY_NETWORK or set it to gin");
  setenv("FERRY_NETWORK", "gin", 1);
}

// One rank of a launched job: the measures between the communicator's ranks.
int run_p2p(Options const& options) {
  Settings const s = settings_from(options);
  FERRY_CHECK_CONFIG(!s.one_gpu,
                     "--one-gpu runs every virtual rank in the process started by hand, and this one is "
                     "a rank of a launched job (RANK is set); start ferry p2p --one-gpu without a launcher");
  if (s.transport == transport::Kind::gin) ask_for_gin();
  auto comm = Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()),
                                   CommunicatorOptions{Backend::cuda, -1});
  FERRY_CHECK_CONFIG(comm->world() >= 2, "ferry p2p needs 2 ranks (one per GPU), got world=", comm->world(),
                     "; run it on a host with 2 or more GPUs, or pass --nproc 2");
  bool const printer = comm->rank() == 0;
  std::string const device = device_name(comm->device());
  std::vector<Record> records;
  {
    bool const nvlink_ops = s.wants(Op::push) || s.wants(Op::pull) || s.wants(Op::copy_engine) ||
                            (s.wants(Op::latency) && s.transport == transport::Kind::lsa);
    std::unique_ptr<P2p> lsa;
    std::unique_ptr<SeamMeasures> seam;
    if (nvlink_ops) lsa = std::make_unique<P2p>(*comm, s);
    if (s.wants(Op::put_signal) || s.transport != transport::Kind::lsa) seam = make_seam_measures(comm.get(), s);
    records = sweep(s, {lsa.get(), seam.get()}, comm->world(), device, printer);
  }
  if (printer && !s.json.empty()) write_json(s, device, comm->world(), records);
  return 0;
}

// --one-gpu: every rank a virtual rank of this process on GPU 0 (NCCL allows one rank per GPU, so no communicator).
int run_one_gpu(Settings const& s) {
  FERRY_CHECK_CONFIG(cuda_device_count() >= 1, "--one-gpu needs a GPU, and this host shows none");
  FERRY_CHECK_CUDA(cudaSetDevice(0));
  std::string const device = device_name(0);
  std::vector<Record> records;
  {
    std::unique_ptr<SeamMeasures> const seam = make_seam_measures(nullptr, s);
    records = sweep(s, {nullptr, seam.get()}, seam->world(), device, true);
  }
  if (!s.json.empty()) write_json(s, device, s.nproc, records);
  return 0;
}

// GIN set up for this process alone (a world of one: the communicator sets GIN up whatever the world), so that a
// host without enough GPUs for the ranks says first whether it has GIN at all: the communicator's ConfigError names
// what is missing and how to get it.
void probe_gin() {
  ask_for_gin();
  Communicator::create(make_socket_bootstrap(SocketBootstrapOptions{}), CommunicatorOptions{Backend::cuda, 0});
}

}  // namespace

int p2p_main(int argc, char** argv) {
  Options options = make_options();
  if (!options.parse(argc, argv)) return 0;  // --help printed
  if (is_rank_process()) return run_rank("p2p", [&] { return run_p2p(options); });
  // a bad option is one error here, not one per rank; the result file is checked before any rank measures
  Settings const s = settings_from(options);
  util::check_result_path(s.json, "--json");
  if (s.one_gpu) return run_one_gpu(s);
  int const gpus = cuda_device_count();
  FERRY_CHECK_CONFIG(s.nproc >= 2, "--nproc ", s.nproc, ": ferry p2p needs 2 ranks");
  if (s.transport == transport::Kind::gin && gpus >= 1 && gpus < s.nproc) probe_gin();
  FERRY_CHECK_CONFIG(gpus >= s.nproc, "ferry p2p needs ", s.nproc, " GPUs (one per rank) but this host shows ", gpus,
                     "; run it on a machine with 2 or more GPUs (check nvidia-smi and CUDA_VISIBLE_DEVICES), or "
                     "time the emulated transport's protocol on one GPU with --transport emulated --one-gpu");
  return launch_self("p2p", argc, argv, s.nproc);
}

}  // namespace ferry::cli
