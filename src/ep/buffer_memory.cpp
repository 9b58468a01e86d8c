// The memory of an EpBuffer's config (buffer_memory.hpp): each backend's areas, from the config and the world alone.
#include "ep/buffer_memory.hpp"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <string>

#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry::detail {
namespace {

// a x b x ..., saturating: sizes a user sets can multiply past 64 bits
uint64_t product(std::initializer_list<uint64_t> factors) {
  unsigned __int128 out = 1;
  for (uint64_t const f : factors) {
    out *= f;
    if (out > UINT64_MAX) return UINT64_MAX;
  }
  return static_cast<uint64_t>(out);
}

uint64_t plus(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

uint64_t align16(uint64_t bytes) {
  return bytes >= UINT64_MAX - 15 ? UINT64_MAX : (bytes + 15) / 16 * 16;
}

class Areas {
 public:
  explicit Areas(BufferMemory& out) : out_(out) {}
  void symmetric(char const* name, uint64_t bytes) { add(name, bytes, out_.symmetric); }
  void local(char const* name, uint64_t bytes) { add(name, bytes, out_.local); }

 private:
  void add(char const* name, uint64_t bytes, uint64_t& sum) {
    if (bytes == 0) return;
    out_.areas.push_back({name, bytes});
    sum = plus(sum, bytes);
  }
  BufferMemory& out_;
};

// The sizes both backends' areas are made of.
struct Sizes {
  uint64_t world, nodes, local, topk, hidden, max_tokens, num_local, slots;
  uint64_t capacity;       // rows of the rank-major receive buffers (EpConfig::recv_capacity)
  uint64_t dispatch_row;   // a dispatch wire row
  uint64_t combine_row;    // a combine wire row
  uint64_t out_row;        // a delivered row (EpConfig::recv_row_bytes)
  uint64_t meta;           // topk ids and weights of a row (8 bytes per entry)
  uint64_t expert_scales;  // the scales of one expert's slots (quantized delivery)
  bool low_latency, hierarchical, quantized_out, token_scale;
};

Sizes sizes_of(EpConfig const& config, Topology const& topology) {
  int const world = topology.world();
  WireRowLayout const dispatch = wire_row_layout(config.dispatch_format, config.hidden);
  Sizes s{};
  s.world = static_cast<uint64_t>(world);
  s.nodes = static_cast<uint64_t>(topology.nodes);
  s.local = static_cast<uint64_t>(topology.local);
  s.topk = static_cast<uint64_t>(config.topk);
  s.hidden = static_cast<uint64_t>(config.hidden);
  s.max_tokens = static_cast<uint64_t>(config.max_tokens_per_rank);
  s.num_local = static_cast<uint64_t>(config.num_local_experts(world));
  s.slots = static_cast<uint64_t>(config.expert_slots());
  s.capacity = static_cast<uint64_t>(config.recv_capacity(world));
  s.dispatch_row = dispatch.row_bytes;
  s.combine_row = wire_row_bytes(config.combine_format, config.hidden);
  s.out_row = config.recv_row_bytes();
  s.meta = s.topk * 8;
  s.quantized_out = config.delivers_quantized();
  s.token_scale = dispatch.has_token_scale;
  s.expert_scales = s.quantized_out ? scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout,
                                                         config.expert_slots(), config.hidden)
                                    : 0;
  s.low_latency = config.mode == Mode::low_latency;
  s.hierarchical = topology.nodes > 1 && config.route() == InternodeRoute::forward;
  return s;
}

// The cpu backend (src/ep/cpu/cpu_ep.cpp): the landing areas in every rank's segment, the expert-major layout and the
// delivered quantized rows in host memory.
void cpu_areas(EpConfig const& config, Sizes const& s, Areas& areas) {
  uint64_t const combine_stride = s.nodes > 1 ? std::max(s.combine_row, s.hidden * 2) : s.combine_row;
  areas.symmetric("count matrix", product({s.world, s.world, 8}));
  areas.symmetric("receive rows", product({s.capacity, s.dispatch_row}));
  areas.symmetric("receive metadata", product({s.capacity, plus(s.meta, 8)}));
  areas.symmetric("combine rows", product({s.capacity, combine_stride}));
  if (!s.low_latency) areas.symmetric("weight gradients", product({s.max_tokens, s.topk, 4}));
  uint64_t const fwd_entries = product({config.rank_masking ? s.world : s.nodes, s.max_tokens});
  if (s.hierarchical)
    areas.symmetric("forward areas",
                    product({fwd_entries, plus(plus(s.dispatch_row, s.combine_row), plus(s.meta, 8))}));
  areas.local("expert-major layout", product({s.num_local, s.slots, s.out_row}));
  areas.local("expert-major index", plus(product({s.num_local, s.slots, 4}), product({s.capacity, s.topk, 4})));
  if (!s.low_latency && config.dispatch_format != WireFormat::bf16)
    areas.local(
        "delivered rows",
        plus(product({s.capacity, s.out_row}),
             s.quantized_out ? scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout,
                                                  config.recv_capacity(static_cast<int>(s.world)), config.hidden)
                             : 0));
  if (s.quantized_out && s.slots > 0)
    areas.local("expert-major scales",
                plus(product({s.num_local, s.expert_scales}),
                     plus(s.token_scale ? product({s.num_local, s.slots, 4}) : 0, product({s.slots, s.dispatch_row}))));
  if (s.hierarchical) areas.local("forward index", product({fwd_entries, s.local, 4}));
}

// The cuda backend (src/ep/cuda/buffers.cu: make_sym_layout, make_hier_sym_layout, allocate_buffers): its landing
// slots, [2 parities][world][max_tokens], hold each row with a record of 16-byte multiples.
void cuda_areas(EpConfig const& config, Sizes const& s, Areas& areas) {
  uint64_t const slots2 = product({2, s.world, s.max_tokens});
  uint64_t const record = align16(s.meta);
  if (s.low_latency) {
    areas.symmetric("landing zone", product({slots2, plus(record, plus(s.dispatch_row, s.combine_row))}));
    if (s.nodes > 1) {
      areas.symmetric("send staging",
                      plus(product({2, s.max_tokens, s.dispatch_row}), product({slots2, plus(record, s.combine_row)})));
      if (s.hierarchical) {
        uint64_t const per_node = product({2, s.nodes, s.max_tokens});
        areas.symmetric("forward areas", product({per_node, plus(plus(s.dispatch_row, s.combine_row),
                                                                 plus(record, product({s.local, s.hidden, 2})))}));
      }
    }
  } else {
    WireRowLayout const dispatch = wire_row_layout(config.dispatch_format, config.hidden);
    uint64_t const scales = s.quantized_out ? product({s.capacity, static_cast<uint64_t>(dispatch.num_scales),
                                                       static_cast<uint64_t>(dispatch.scale_bytes)})
                                            : 0;
    areas.symmetric("receive rows", plus(product({s.capacity, s.out_row}), scales));
    if (config.dispatch_format != WireFormat::bf16 && config.dispatch_dequantize)
      areas.symmetric("receive wire rows", product({s.capacity, s.dispatch_row}));
    areas.symmetric("receive metadata", product({s.capacity, plus(s.meta, 8)}));
    areas.symmetric("combine landing zone", product({slots2, s.combine_row}));
    areas.symmetric("weight gradients", product({2, s.max_tokens, s.topk, 8}));
    if (s.nodes > 1) {
      uint64_t const hier_record = align16((1 + s.local + 2 * s.topk) * 4);
      uint64_t const per_node = product({s.nodes, s.max_tokens});
      areas.symmetric("forward areas",
                      plus(plus(product({s.max_tokens, s.dispatch_row}),
                                product({per_node, plus(plus(s.dispatch_row, s.combine_row), 2 * hier_record)})),
                           product({2, per_node, s.local, s.hidden, 2})));
    }
  }
  areas.local("expert-major layout",
              plus(product({s.num_local, s.slots, s.out_row}), product({s.num_local, s.expert_scales})));
  areas.local("expert-major index",
              product({s.low_latency ? product({s.world, s.max_tokens}) : s.capacity, s.topk, 4}));
}

uint64_t meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return product({kib, 1024});
  long const pages = sysconf(_SC_AVPHYS_PAGES);
  long const page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? product({static_cast<uint64_t>(pages), static_cast<uint64_t>(page)}) : UINT64_MAX;
}

uint64_t shm_available() {
  struct statvfs fs {};
  if (statvfs("/dev/shm", &fs) != 0) return UINT64_MAX;
  return product({static_cast<uint64_t>(fs.f_bavail), static_cast<uint64_t>(fs.f_frsize)});
}

}  // namespace

uint64_t BufferMemory::total() const {
  return plus(symmetric, local);
}

std::string bytes_text(uint64_t bytes) {
  if (bytes == UINT64_MAX) return "more than 16 EiB";
  char text[32];
  double const gib = static_cast<double>(bytes) / (1ull << 30);
  if (gib >= 1.0)
    std::snprintf(text, sizeof(text), "%.1f GiB", gib);
  else
    std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1ull << 20));
  return text;
}

std::string BufferMemory::describe() const {
  std::vector<MemoryArea> largest = areas;
  std::stable_sort(largest.begin(), largest.end(), [](auto const& a, auto const& b) { return a.bytes > b.bytes; });
  std::string text = concat(bytes_text(total()), " (", total(), " bytes): ");
  for (std::size_t i = 0; i < largest.size() && i < 3; ++i)
    text += concat(i ? ", " : "", largest[i].name, " ", bytes_text(largest[i].bytes));
  return text;
}

BufferMemory buffer_memory(EpConfig const& config, Topology const& topology, Backend backend) {
  BufferMemory out;
  Areas areas(out);
  Sizes const s = sizes_of(config, topology);
  if (backend == Backend::cpu)
    cpu_areas(config, s, areas);
  else
    cuda_areas(config, s, areas);
  return out;
}

FreeMemory free_memory(Communicator const& comm) {
  FreeMemory free;
  if (comm.backend() == Backend::cpu) {
    free.shared = shm_available();
    free.local = meminfo_available();
    return free;
  }
#if FERRY_HAVE_CUDA
  std::size_t device_free = 0, device_total = 0;
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && cudaSetDevice(comm.device()) == cudaSuccess &&
      cudaMemGetInfo(&device_free, &device_total) == cudaSuccess)
    free.local = device_free;
  if (current >= 0) cudaSetDevice(current);
#endif
  return free;
}

std::string memory_shortfall(BufferMemory const& need, FreeMemory const& free, Backend backend, int ranks_on_host) {
  uint64_t const ranks = static_cast<uint64_t>(std::max(ranks_on_host, 1));
  if (backend == Backend::cuda) {
    if (need.total() <= free.local) return "";
    return concat("needs ", bytes_text(need.total()), " of device memory (", need.total(), " bytes), ",
                  bytes_text(free.local), " (", free.local, " bytes) free (cudaMemGetInfo)");
  }
  uint64_t const shared = product({ranks, need.symmetric});
  uint64_t const all = product({ranks, need.total()});
  if (shared > free.shared)
    return concat("needs ", bytes_text(shared), " of shared memory for the ", ranks, " ranks of this host (", ranks,
                  " x ", need.symmetric, " bytes), ", bytes_text(free.shared), " (", free.shared,
                  " bytes) free in /dev/shm");
  if (all > free.local)
    return concat("needs ", bytes_text(all), " of memory for the ", ranks, " ranks of this host (", ranks, " x ",
                  need.total(), " bytes), ", bytes_text(free.local), " (", free.local,
                  " bytes) of physical memory free (MemAvailable)");
  return "";
}

}  // namespace ferry::detail

namespace ferry {

BufferFootprint buffer_footprint(EpConfig const& config, Topology const& topology, Backend backend) {
  config.validate(topology.world());
  detail::BufferMemory const memory = detail::buffer_memory(config.resolved(topology.world()), topology, backend);
  return BufferFootprint{memory.symmetric, memory.local, memory.describe()};
}

}  // namespace ferry
