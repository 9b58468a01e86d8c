// Communicator: rank, world, local peers, the symmetric heap, and the POD DeviceView handed to kernels.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ferry/bootstrap.hpp"
#include "ferry/device_view.hpp"

// The same declaration CUDA's runtime makes; keeps this header free of CUDA includes.
typedef struct CUstream_st* cudaStream_t;

namespace ferry {

// How a world is laid out over nodes: N nodes x M local ranks, world rank r = node * M + local (torchrun's order).
// A world has at most kMaxWorld ranks (256 = 32 nodes x 8); which peers a rank reaches by load/store is the
// communicator's to say (Communicator::load_store_reachable).
struct Topology {
  int nodes = 1;
  int local = 1;  // ranks per node
  int world() const { return nodes * local; }
  int node_of(int rank) const { return rank / local; }
  int local_of(int rank) const { return rank % local; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
};

// "NxM" (e.g. "2x8"): N nodes of M ranks, both at least 1, N x M at most kMaxWorld. Throws ConfigError naming the
// text and the form or the bound.
Topology parse_topology(std::string const& text);

// "2x8"
std::string topology_name(Topology const& topology);

// The topology of a world of `world` ranks of which `local_world` share this rank's host: `forced` when not empty
// (FERRY_TOPOLOGY: emulated nodes on one host; N x M must equal world), else world / local_world nodes of
// local_world ranks. Throws ConfigError when local_world does not divide world or `forced` does not match it.
Topology topology_of(int world, int local_world, std::string const& forced);

enum class Backend {
  cpu,   // POSIX shared memory mapped by every rank process; the reference backend
  cuda,  // NCCL 2.28+ device API: symmetric windows, LSA pointers over NVLink
};

char const* backend_name(Backend backend);
// "cpu" / "cuda"; throws ConfigError naming the value and the choices.
Backend parse_backend(std::string const& name);
// True when this build has the cuda backend and at least one GPU is visible.
bool cuda_available();
// Number of visible GPUs (0 when the build has no cuda backend).
int cuda_device_count();

struct CommunicatorOptions {
  Backend backend = Backend::cpu;
  // cuda: the GPU of this rank; -1 means bootstrap.local_rank().
  int device = -1;
  // "NxM": N emulated nodes of M ranks on this host (as FERRY_TOPOLOGY, which it overrides); empty: FERRY_TOPOLOGY,
  // else LOCAL_WORLD_SIZE ranks per node.
  std::string topology;
};

// One region of symmetric memory: `bytes` on every rank. Owned by the communicator; valid until it is destroyed.
struct SymmetricRegion {
  void* local = nullptr;  // this rank's copy (host memory on cpu, device memory on cuda)
  SymmetricView view{};   // the load/store team's copies, as kernels address them
  // [world] every rank's copy as addressable from here, null where only the network reaches it (cuda: outside the
  // NVLink team; cpu: none, every rank maps every segment, so the cpu backend emulates the network through them).
  std::vector<char*> ranks;
  char* of(int rank) const { return ranks[static_cast<std::size_t>(rank)]; }
};

class Communicator {
 public:
  // Collective: every rank calls it with the same backend. Takes ownership of the bootstrap.
  // Throws ConfigError (bad options), CudaError / NcclError (transport setup), BootstrapError.
  static std::unique_ptr<Communicator> create(std::unique_ptr<Bootstrap> bootstrap, CommunicatorOptions const& options);

  virtual ~Communicator() = default;

  virtual Backend backend() const = 0;
  int rank() const { return bootstrap().rank(); }
  int world() const { return bootstrap().world(); }
  virtual Bootstrap& bootstrap() const = 0;
  // cuda: the device ordinal; cpu: -1.
  virtual int device() const = 0;
  // The world's nodes (FERRY_TOPOLOGY, else LOCAL_WORLD_SIZE ranks per node) and whether `peer` is reachable from
  // this rank by load/store (cuda: in this rank's NVLink team, as NCCL reports it; cpu: on this rank's node, emulated
  // or not). Peers that are not are reached through a network transport.
  virtual Topology const& topology() const = 0;
  virtual bool load_store_reachable(int peer) const = 0;

  // Collective, same order and sizes on every rank: allocates `bytes` (rounded up to the window alignment) of
  // zeroed symmetric memory. Throws ConfigError if sizes differ between ranks.
  virtual SymmetricRegion alloc_symmetric(std::size_t bytes) = 0;

  // Gives a region back. Local and never throws (destructors call it): the cpu backend unmaps this rank's mapping at
  // once (the memory goes when the last rank unmaps); the cuda backend marks it released, and the next
  // alloc_symmetric (collective) reuses or frees the regions that every rank has released, so a buffer that is
  // created and dropped again and again holds one region, not one per cycle. The caller must be done with the
  // region on the device (its kernels finished) and no peer may use it afterwards except through a later
  // alloc_symmetric that hands it out again.
  virtual void release_symmetric(SymmetricRegion const& region) noexcept = 0;

  // Collective refusals (DESIGN "Collective consistency"). A rank that refuses a call's input posts its reason here
  // before it joins the call's exchange with its abort flag; a peer whose exchange saw the flag reads the reason with
  // refusal_of and raises InputError naming that rank. Cold path: a few hundred bytes through the transport.
  virtual void post_refusal(std::string const& reason) = 0;
  virtual std::string refusal_of(int rank) = 0;

  // The view kernels (or the cpu reference) receive. Stable for the communicator's lifetime.
  virtual DeviceView const& device_view() const = 0;

  // Raises the error a kernel recorded in the error block (TimeoutError naming rank, peer and phase; InputError
  // for ids or rows dropped on the device, or for a call a peer refused, naming that rank and its reason). Only a
  // timeout marks the communicator failed: a peer may be gone, so no later collective can be trusted; after an
  // InputError the communicator stays usable (docs/errors.md). Cheap: reads host-visible memory. stream is
  // synchronised first on cuda when non-null.
  virtual void check_errors(cudaStream_t stream = nullptr) = 0;
  // True after a device timeout; every later call then throws Error saying so.
  virtual bool failed() const = 0;
  // Throws if failed() (naming the original failure).
  virtual void ensure_usable() const = 0;

  // A barrier over every rank through the transport (device barrier on cuda, enqueued on stream; shared memory on
  // cpu). Bounded by FERRY_TIMEOUT_S.
  virtual void barrier(cudaStream_t stream = nullptr) = 0;
};

}  // namespace ferry
