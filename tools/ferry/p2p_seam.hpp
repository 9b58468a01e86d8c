// ferry p2p's measures through the transport seam (p2p_seam.cuh's kernels), behind one non-template interface: the
// transport of Settings::transport, between the ranks of a communicator (one per process and GPU) or between
// Settings::nproc virtual ranks of this process on its one GPU (--one-gpu, emulated only).
#pragma once

#include <cstddef>
#include <memory>

#include "ferry/communicator.hpp"
#include "p2p_settings.hpp"

namespace ferry::cli::p2p {

class SeamMeasures {
 public:
  virtual ~SeamMeasures() = default;
  virtual int world() const = 0;
  // Whether `ctas` CTAs of every rank that one launch holds fit on the GPU at once (virtual ranks wait for each
  // other's CTAs, so all of them must be resident; always true with one rank per GPU).
  virtual bool fits(int ctas) const = 0;
  // Median microseconds of one exchange of `bytes` (alltoall: to each peer) by put_signal over `ctas` CTAs per rank,
  // of the slowest rank, the receivers' waits included. Collective over the communicator's ranks.
  virtual double time_put_signal(Direction direction, std::size_t bytes, int ctas) = 0;
  // Median one-way latency in microseconds (a signal round trip between ranks 0 and 1, / 2). Collective.
  virtual double time_latency() = 0;
};

// Over `comm`'s ranks (collective: every rank calls it), or, with comm == nullptr, over settings.nproc virtual ranks
// on the current GPU. Throws ConfigError where the transport cannot be had (gin: the communicator has no GIN).
std::unique_ptr<SeamMeasures> make_seam_measures(Communicator* comm, Settings const& settings);

}  // namespace ferry::cli::p2p
