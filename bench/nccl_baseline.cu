// NCCL all-to-all baseline (see nccl_baseline.hpp).
#include "nccl_baseline.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cub/cub.cuh>
#include <vector>

#include "core/cuda_check.hpp"
#include "ferry/error.hpp"

namespace ferry {
namespace {

constexpr int kThreads = 256;

// flag[d * T + t] = 1 when token t has a valid expert on rank d (bad ids dropped, as Ferry does).
template <typename IdxT>
__global__ void mark_kernel(IdxT const* idx, int num_tokens, int topk, int num_experts, int num_local, int world,
                            int32_t* flag) {
  int const t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  uint32_t mask = 0;
  for (int k = 0; k < topk; ++k) {
    int64_t const e = static_cast<int64_t>(idx[static_cast<std::size_t>(t) * topk + k]);
    if (e >= 0 && e < num_experts) mask |= 1u << (static_cast<int>(e) / num_local);
  }
  for (int d = 0; d < world; ++d) flag[d * num_tokens + t] = (mask >> d) & 1u;
}

// Per-destination send counts from the exclusive scan: count[d] = pos[(d+1)T] - pos[dT].
__global__ void counts_kernel(int32_t const* flag, int32_t const* pos, int num_tokens, int world, int32_t* counts) {
  int const d = threadIdx.x;
  if (d >= world) return;
  int const n = world * num_tokens;
  int32_t const total = n == 0 ? 0 : pos[n - 1] + flag[n - 1];
  int32_t const begin = num_tokens == 0 ? 0 : pos[d * num_tokens];
  int32_t const end = d + 1 < world ? pos[(d + 1) * num_tokens] : total;
  counts[d] = num_tokens == 0 ? 0 : end - begin;
}

// Permute: warp per (token, destination): the row and its metadata into the send buffers, grouped by destination.
template <typename IdxT>
__global__ void pack_kernel(int4 const* x, IdxT const* idx, float const* weights, int32_t const* flag,
                            int32_t const* pos, int num_tokens, int hidden, int topk, int num_experts, int num_local,
                            int world, int rank, int4* send_x, int32_t* send_idx, float* send_w, int2* send_src) {
  int const warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int const lane = threadIdx.x % 32;
  if (warp >= world * num_tokens) return;
  if (!flag[warp]) return;
  int const d = warp / num_tokens;
  int const t = warp % num_tokens;
  std::size_t const p = static_cast<std::size_t>(pos[warp]);
  int const num_vec = hidden / 8;
  for (int i = lane; i < num_vec; i += 32) send_x[p * num_vec + i] = x[static_cast<std::size_t>(t) * num_vec + i];
  if (lane < topk) {
    int64_t const e = static_cast<int64_t>(idx[static_cast<std::size_t>(t) * topk + lane]);
    bool const local = e >= 0 && e < num_experts && static_cast<int>(e) / num_local == d;
    send_idx[p * topk + lane] = local ? static_cast<int32_t>(e) - d * num_local : -1;
    send_w[p * topk + lane] = local ? weights[static_cast<std::size_t>(t) * topk + lane] : 0.0f;
  }
  if (lane == 0) send_src[p] = make_int2(rank, t);
}

__global__ void expert_count_kernel(int32_t const* recv_idx, int entries, int num_local, int32_t* counts) {
  int const f = blockIdx.x * blockDim.x + threadIdx.x;
  if (f < entries && recv_idx[f] >= 0 && recv_idx[f] < num_local) atomicAdd(&counts[recv_idx[f]], 1);
}

// Unpermute + reduce: y[t] = bf16(sum over d ascending of float(ret[pos[d, t]])), warp per token.
__global__ void reduce_kernel(int4 const* ret, int32_t const* flag, int32_t const* pos, int num_tokens, int hidden,
                              int world, int4* y) {
  int const t = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int const lane = threadIdx.x % 32;
  if (t >= num_tokens) return;
  int const num_vec = hidden / 8;
  for (int i = lane; i < num_vec; i += 32) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int d = 0; d < world; ++d) {
      if (!flag[d * num_tokens + t]) continue;
      int4 const v = ret[static_cast<std::size_t>(pos[d * num_tokens + t]) * num_vec + i];
      auto const* h = reinterpret_cast<__nv_bfloat162 const*>(&v);
      for (int j = 0; j < 4; ++j) {
        float2 const f = __bfloat1622float2(h[j]);
        acc[2 * j] = __fadd_rn(acc[2 * j], f.x);
        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], f.y);
      }
    }
    int4 out;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&out);
    for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    y[static_cast<std::size_t>(t) * num_vec + i] = out;
  }
}

template <typename T>
T* alloc(std::size_t count) {
  void* p = nullptr;
  FERRY_CHECK_CUDA(cudaMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

}  // namespace

struct NcclBaseline::State {
  EpConfig config;
  int world = 0, rank = 0, num_local = 0, rows = 0;
  ncclComm_t nccl = nullptr;
  int32_t *flag = nullptr, *pos = nullptr, *send_counts = nullptr, *recv_counts = nullptr, *num_recv = nullptr;
  int32_t* host_counts = nullptr;  // pinned [2 * world]: send, then recv
  void* scan_temp = nullptr;
  std::size_t scan_temp_bytes = 0;
  int4 *send_x = nullptr, *recv_x = nullptr, *ret = nullptr;
  int32_t *send_idx = nullptr, *recv_idx = nullptr, *expert_counts = nullptr;
  float *send_w = nullptr, *recv_w = nullptr;
  int2 *send_src = nullptr, *recv_src = nullptr;
  int num_tokens = 0;
  std::vector<int> send_off, recv_off;  // rows, per peer
};

NcclBaseline::NcclBaseline(Communicator& comm, EpConfig const& config) : state_(new State) {
  State& s = *state_;
  config.validate(comm.world());
  s.config = config;
  s.world = comm.world();
  s.rank = comm.rank();
  s.num_local = config.num_local_experts(s.world);
  s.rows = s.world * config.max_tokens_per_rank;
  FERRY_CHECK_CUDA(cudaSetDevice(comm.device()));
  ncclUniqueId id{};
  if (s.rank == 0) FERRY_CHECK_NCCL(ncclGetUniqueId(&id));
  comm.bootstrap().broadcast(&id, sizeof(id), 0);
  FERRY_CHECK_NCCL(ncclCommInitRank(&s.nccl, s.world, id, s.rank));
  std::size_t const rows = static_cast<std::size_t>(s.rows);
  std::size_t const vec = static_cast<std::size_t>(config.hidden) / 8;
  s.flag = alloc<int32_t>(rows);
  s.pos = alloc<int32_t>(rows);
  s.send_counts = alloc<int32_t>(s.world);
  s.recv_counts = alloc<int32_t>(s.world);
  s.num_recv = alloc<int32_t>(1);
  FERRY_CHECK_CUDA(cudaMallocHost(&s.host_counts, 2 * s.world * sizeof(int32_t)));
  FERRY_CHECK_CUDA(cub::DeviceScan::ExclusiveSum(nullptr, s.scan_temp_bytes, s.flag, s.pos, s.rows));
  s.scan_temp = alloc<char>(s.scan_temp_bytes);
  s.send_x = alloc<int4>(rows * vec);
  s.recv_x = alloc<int4>(rows * vec);
  s.ret = alloc<int4>(rows * vec);
  s.send_idx = alloc<int32_t>(rows * config.topk);
  s.recv_idx = alloc<int32_t>(rows * config.topk);
  s.send_w = alloc<float>(rows * config.topk);
  s.recv_w = alloc<float>(rows * config.topk);
  s.send_src = alloc<int2>(rows);
  s.recv_src = alloc<int2>(rows);
  s.expert_counts = alloc<int32_t>(s.num_local);
  s.send_off.assign(s.world + 1, 0);
  s.recv_off.assign(s.world + 1, 0);
}

NcclBaseline::~NcclBaseline() {
  State& s = *state_;
  if (s.nccl) ncclCommDestroy(s.nccl);
  for (void* p :
       {static_cast<void*>(s.flag), static_cast<void*>(s.pos), static_cast<void*>(s.send_counts),
        static_cast<void*>(s.recv_counts), static_cast<void*>(s.num_recv), s.scan_temp, static_cast<void*>(s.send_x),
        static_cast<void*>(s.recv_x), static_cast<void*>(s.ret), static_cast<void*>(s.send_idx),
        static_cast<void*>(s.recv_idx), static_cast<void*>(s.send_w), static_cast<void*>(s.recv_w),
        static_cast<void*>(s.send_src), static_cast<void*>(s.recv_src), static_cast<void*>(s.expert_counts)})
    if (p) cudaFree(p);
  if (s.host_counts) cudaFreeHost(s.host_counts);
  delete state_;
}

DispatchResult NcclBaseline::dispatch(DispatchArgs const& args, cudaStream_t stream) {
  State& s = *state_;
  EpConfig const& c = s.config;
  FERRY_CHECK_INPUT(!args.expand, "the NCCL baseline has no expert-major layout; use expand=false");
  FERRY_CHECK_INPUT(args.num_tokens >= 0 && args.num_tokens <= c.max_tokens_per_rank, "num_tokens=", args.num_tokens,
                    " is outside [0, ", c.max_tokens_per_rank, "]");
  int const T = args.num_tokens;
  int const n = s.world * T;
  s.num_tokens = T;
  // 1. destinations of every token, positions in the send buffer (grouped by destination, token order)
  if (T > 0) {
    unsigned const blocks = static_cast<unsigned>((T + kThreads - 1) / kThreads);
    if (args.topk_idx_type == IndexType::int64)
      mark_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<int64_t const*>(args.topk_idx), T, c.topk, c.num_experts,
                                                   s.num_local, s.world, s.flag);
    else
      mark_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<int32_t const*>(args.topk_idx), T, c.topk, c.num_experts,
                                                   s.num_local, s.world, s.flag);
    FERRY_CHECK_CUDA(cub::DeviceScan::ExclusiveSum(s.scan_temp, s.scan_temp_bytes, s.flag, s.pos, n, stream));
  }
  counts_kernel<<<1, 32, 0, stream>>>(s.flag, s.pos, T, s.world, s.send_counts);
  // 2. permute
  if (T > 0) {
    unsigned const blocks = static_cast<unsigned>((static_cast<int64_t>(n) * 32 + kThreads - 1) / kThreads);
    if (args.topk_idx_type == IndexType::int64)
      pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<int4 const*>(args.x),
                                                   static_cast<int64_t const*>(args.topk_idx), args.topk_weights,
                                                   s.flag, s.pos, T, c.hidden, c.topk, c.num_experts, s.num_local,
                                                   s.world, s.rank, s.send_x, s.send_idx, s.send_w, s.send_src);
    else
      pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<int4 const*>(args.x),
                                                   static_cast<int32_t const*>(args.topk_idx), args.topk_weights,
                                                   s.flag, s.pos, T, c.hidden, c.topk, c.num_experts, s.num_local,
                                                   s.world, s.rank, s.send_x, s.send_idx, s.send_w, s.send_src);
  }
  FERRY_CHECK_CUDA(cudaGetLastError());
  // 3. count all-to-all, then the host learns the sizes
  FERRY_CHECK_NCCL(ncclGroupStart());
  for (int peer = 0; peer < s.world; ++peer) {
    FERRY_CHECK_NCCL(ncclSend(s.send_counts + peer, 1, ncclInt32, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclRecv(s.recv_counts + peer, 1, ncclInt32, peer, s.nccl, stream));
  }
  FERRY_CHECK_NCCL(ncclGroupEnd());
  FERRY_CHECK_CUDA(
      cudaMemcpyAsync(s.host_counts, s.send_counts, s.world * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  FERRY_CHECK_CUDA(cudaMemcpyAsync(s.host_counts + s.world, s.recv_counts, s.world * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, stream));
  FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  for (int peer = 0; peer < s.world; ++peer) {
    s.send_off[peer + 1] = s.send_off[peer] + s.host_counts[peer];
    s.recv_off[peer + 1] = s.recv_off[peer] + s.host_counts[s.world + peer];
  }
  int const num_recv = s.recv_off[s.world];
  // 4. all-to-allv of rows and metadata, landing rank-major (sources ascending, their tokens in order)
  std::size_t const H = static_cast<std::size_t>(c.hidden);
  std::size_t const K = static_cast<std::size_t>(c.topk);
  FERRY_CHECK_NCCL(ncclGroupStart());
  for (int peer = 0; peer < s.world; ++peer) {
    std::size_t const so = s.send_off[peer], sc = s.host_counts[peer];
    std::size_t const ro = s.recv_off[peer], rc = s.host_counts[s.world + peer];
    auto* sx = reinterpret_cast<char*>(s.send_x) + so * H * 2;
    auto* rx = reinterpret_cast<char*>(s.recv_x) + ro * H * 2;
    FERRY_CHECK_NCCL(ncclSend(sx, sc * H, ncclBfloat16, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclRecv(rx, rc * H, ncclBfloat16, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclSend(s.send_idx + so * K, sc * K, ncclInt32, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclRecv(s.recv_idx + ro * K, rc * K, ncclInt32, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclSend(s.send_w + so * K, sc * K, ncclFloat32, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclRecv(s.recv_w + ro * K, rc * K, ncclFloat32, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclSend(s.send_src + so, sc * 2, ncclInt32, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclRecv(s.recv_src + ro, rc * 2, ncclInt32, peer, s.nccl, stream));
  }
  FERRY_CHECK_NCCL(ncclGroupEnd());
  // 5. per-expert counts (the bincount engines run for their grouped GEMM)
  FERRY_CHECK_CUDA(cudaMemsetAsync(s.expert_counts, 0, std::max(1, s.num_local) * sizeof(int32_t), stream));
  int const entries = num_recv * c.topk;
  if (entries > 0)
    expert_count_kernel<<<(entries + kThreads - 1) / kThreads, kThreads, 0, stream>>>(s.recv_idx, entries, s.num_local,
                                                                                      s.expert_counts);
  FERRY_CHECK_CUDA(cudaMemcpyAsync(s.num_recv, &s.recv_off[s.world], sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  FERRY_CHECK_CUDA(cudaGetLastError());
  DispatchResult r;
  r.recv_x = s.recv_x;
  r.recv_topk_idx = s.recv_idx;
  r.recv_topk_weights = s.recv_w;
  r.recv_src = reinterpret_cast<int32_t*>(s.recv_src);
  r.num_recv = s.num_recv;
  r.num_recv_host = num_recv;
  r.expert_counts = s.expert_counts;
  r.recv_capacity = s.rows;
  if (args.eager) FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  return r;
}

void NcclBaseline::combine(void const* rows, void* y, cudaStream_t stream) {
  State& s = *state_;
  std::size_t const H = static_cast<std::size_t>(s.config.hidden);
  // 1. all-to-allv back: the rows of source p go home; they land where the dispatch packed them (pos order)
  FERRY_CHECK_NCCL(ncclGroupStart());
  for (int peer = 0; peer < s.world; ++peer) {
    std::size_t const so = s.send_off[peer], sc = s.host_counts[peer];
    std::size_t const ro = s.recv_off[peer], rc = s.host_counts[s.world + peer];
    FERRY_CHECK_NCCL(ncclSend(static_cast<char const*>(rows) + ro * H * 2, rc * H, ncclBfloat16, peer, s.nccl, stream));
    FERRY_CHECK_NCCL(ncclRecv(reinterpret_cast<char*>(s.ret) + so * H * 2, sc * H, ncclBfloat16, peer, s.nccl, stream));
  }
  FERRY_CHECK_NCCL(ncclGroupEnd());
  // 2. unpermute + sum over ranks
  if (s.num_tokens > 0) {
    unsigned const blocks = static_cast<unsigned>((static_cast<int64_t>(s.num_tokens) * 32 + kThreads - 1) / kThreads);
    reduce_kernel<<<blocks, kThreads, 0, stream>>>(s.ret, s.flag, s.pos, s.num_tokens, s.config.hidden, s.world,
                                                   static_cast<int4*>(y));
  }
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ferry
