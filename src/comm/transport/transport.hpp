// The transport seam: how a kernel reaches its peers. Host and device includable, no CUDA header.
//
// A transport is a small POD (Lsa, Emulated, Gin) that a kernel receives in its Params. A kernel opens an endpoint
// on it for a group of threads (`net.open(group, id)`) and moves data with the endpoint's calls; no virtual call, no
// host involvement. Every implementation keeps this contract, and a protocol written against it runs over any of
// them:
//
//   Windows. Every rank has one symmetric window of the same size (the communicator's SymmetricRegion). Offsets are
//   byte offsets into it, the same on every rank. A signal is a 64-bit counter named by a window offset (8-byte
//   aligned), read only through wait: over lsa and emulated it is the window's word at that offset; over gin it is
//   a GIN signal that the offset names (the Gin maps the offsets of its signal range, 8 bytes apart, onto signal
//   indices; the window's words there are left unused), because NCCL keeps GIN signals outside the windows.
//   Portable protocols keep their counters in one range of the window and never load or store them directly.
//
//   put(peer, dst_off, src_off, bytes)   copies `bytes` (a multiple of 16, both offsets 16-byte aligned) from this
//       rank's window at src_off to `peer`'s window at dst_off. The source must be in the window (registered
//       memory: a network card reads it), written by the group before the call. Nothing is promised about when the
//       bytes arrive, in which order, or in how many pieces, until a signal to that peer says so.
//   put_value(peer, dst_off, value)      an 8-byte put of a value (no source buffer), with put's ordering.
//   signal(peer, signal_off, add)        adds `add` to the counter at `peer`. When a peer observes the new value
//       (wait), every put this endpoint issued to that peer before the signal has arrived there, whole. Puts to
//       other peers are not ordered by it. Counters only grow: the network has no remote "set", so protocols count
//       (a call's sequence number is the number of signals expected so far), never overwrite.
//   put_signal(peer, dst_off, src_off, bytes, signal_off, add)   put, then signal.
//   flush()                              the sources of every put issued so far may be overwritten. Says nothing
//       about arrival (that is what signals are for).
//   wait(view, signal_off, least, peer, phase)   bounded acquire wait until this rank's counter >= least. On expiry
//       it records (rank, peer, phase, least, observed) in the error block and returns false, like every device wait
//       (comm/device/signal.cuh). After it returns true, the group sees every put the signal covers.
//   read(signal_off)                     this rank's counter at signal_off now (acquire, by the calling thread; no
//       wait, no bound): for a protocol that waits against its own deadline and decides itself what a missing signal
//       means (rank masking's agreement). A value it returns covers what wait(least <= value) would.
//   close()                              the endpoint is done; puts nobody signalled are delivered some time later.
//
//   Every thread of the group calls every endpoint call, with the same arguments (the group is a thread, a warp or a
//   CTA: comm/transport/group.cuh); the implementation decides which threads do the work.
//
// Load/store capability. Transports with kLoadStore (Lsa) also hand out each peer's window base (`window(peer)`) and
// a release "set" of a word, so kernels written for NVLink keep storing straight from registers into a peer's
// memory (quantize-on-send, scattered metadata words). A kernel that uses them compiles only over such a transport;
// a protocol meant for the network writes what it sends into its own window first and puts it from there
// (docs/design.md "Transports").
#pragma once

#include <cstdint>

#include "ferry/limits.hpp"

namespace ferry::transport {

enum class Kind : int32_t {
  lsa = 0,       // NVLink load/store through LSA pointers (one NVLink domain)
  emulated = 1,  // the network's semantics between ranks that share memory, with seeded delays and reordering
  gin = 2,       // NCCL's GPU-initiated networking (nccl_device/gin.h): RDMA between nodes (docs/gin.md)
};

char const* kind_name(Kind kind);

// The emulated transport's choices. The defaults are FERRY_EMULATED_SEED, _DELAY_NS and _REORDER's.
struct EmulatedOptions {
  uint64_t seed = 1;
  uint32_t max_delay_ns = 20000;  // each batch of deliveries waits a seeded time in [0, max_delay_ns)
  bool reorder = true;            // deliver a batch's puts (and each put's 16-byte pieces) in a seeded order
};

// FERRY_EMULATED_SEED, FERRY_EMULATED_DELAY_NS and FERRY_EMULATED_REORDER (the env table's rules; ConfigError for a
// value outside them): what an EpBuffer's emulated network between nodes on one host runs with.
EmulatedOptions emulated_options_from_env();

// A 64-bit mix (splitmix64's finaliser): the emulated transport's seeded choices, the same on host and device so
// that a schedule can be replayed and unit-tested on the host.
#if defined(__CUDACC__)
__host__ __device__
#endif
    inline uint64_t
    mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The i-th choice in [0, n) of the stream (seed, stream): what the emulated transport draws for an endpoint's
// delivery order and delays. n > 0.
#if defined(__CUDACC__)
__host__ __device__
#endif
    inline uint32_t
    draw(uint64_t seed, uint64_t stream, uint64_t i, uint32_t n) {
  return static_cast<uint32_t>(mix64(seed ^ mix64(stream ^ mix64(i))) % n);
}

}  // namespace ferry::transport
