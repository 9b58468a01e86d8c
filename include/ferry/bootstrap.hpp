// Bootstrap: how ranks find each other and exchange small host messages before (and beside) the device transport.
// Every operation is collective (all ranks call it in the same order) and bounded: a rank that never arrives or
// dies makes the others throw BootstrapError naming it, within the timeout, never hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace ferry {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;

  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Rank within this host (selects the GPU). Equal to rank() for single-host jobs.
  virtual int local_rank() const = 0;
  // Number of ranks on this host.
  virtual int local_world() const = 0;

  // Errors of the three collectives below: BootstrapError when a rank does not arrive within the timeout, dies or
  // closes its bootstrap, or makes a different call at the same position (the message names the ranks and both
  // calls); after the first failure every later call throws too. InputError for a null buffer with bytes > 0 or
  // a root outside [0, world()).

  // recv must hold world() * bytes; block r of recv receives rank r's send (send may alias recv + rank*bytes).
  virtual void allgather(void const* send, void* recv, std::size_t bytes) = 0;
  // data (bytes long) on root is copied to every rank's data.
  virtual void broadcast(void* data, std::size_t bytes, int root) = 0;
  // Returns once every rank has entered.
  virtual void barrier() = 0;

  // Between collectives (every EpBuffer call makes it; cheap, no communication): throws BootstrapError when the job
  // was stopped since the last collective. SocketBootstrap: rank 0 found that another job shares its port (the
  // clash it names); a rank learns it from rank 0's abort, looked for at most every 100 ms. A rank that is gone is
  // not an error here: the next collective names it.
  virtual void check_alive() {}
};

struct SocketBootstrapOptions {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  int local_world = 1;
  // Deadline for connecting (with retries) and for each collective operation; at most kMaxTimeoutSeconds.
  std::chrono::milliseconds timeout{60000};
  // The job's identity beyond MASTER_ADDR:MASTER_PORT (torchrun's TORCHELASTIC_RUN_ID): every rank of a job gives the
  // same one; rank 0 refuses a rank of another run id as another job's. Empty: none (jobs cannot be told apart by
  // their hellos, see make_socket_bootstrap).
  std::string run_id;
};

// TCP rendezvous: rank 0 listens on master_port (every interface; master_addr is how the others reach it), every
// rank connects to it; collectives go through rank 0 (the messages are small: ids, counts, addresses). Returns
// once all world ranks have joined (a world of 1 opens no socket). Throws BootstrapError on failure (invalid
// options, a rank missing at the deadline, a mismatched WORLD_SIZE, a duplicate RANK, a foreign process on the
// port), with the same reason on every rank that rank 0 can still reach.
// Two jobs, one port: rank 0 holds master_port while its bootstrap lives. A process of another job (another run_id)
// is refused with a BootstrapError naming the job that holds the port and what to set; so is a rank 0 whose port is
// held. Jobs without a run_id are told apart only when the second one shows itself: a rank this job already has, or
// a second rank 0, asking to join within the rendezvous window (rank 0's start + timeout) stops this job on every
// rank (BootstrapError at the next collective or check_alive) as well as the newcomer, since a rank of this job may
// then be the other job's; after the window the newcomer alone is refused.
std::unique_ptr<Bootstrap> make_socket_bootstrap(SocketBootstrapOptions const& options);

// The torchrun environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (LOCAL_WORLD_SIZE if set),
// timeout from FERRY_BOOTSTRAP_TIMEOUT_S. Throws BootstrapError naming a missing or malformed variable.
SocketBootstrapOptions socket_bootstrap_options_from_env();

// world bootstraps for ranks that are threads of one process (tests). Each must be used by its own thread; a
// destroyed one makes the others fail at once in calls it never joined. Throws ConfigError for world < 1 or a
// timeout that is not positive.
std::vector<std::unique_ptr<Bootstrap>> make_local_bootstraps(
    int world, std::chrono::milliseconds timeout = std::chrono::seconds(30));

}  // namespace ferry
