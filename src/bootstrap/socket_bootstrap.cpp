// SocketBootstrap: TCP rendezvous in a star around rank 0 (the master), torchrun-style.
//
// Rendezvous: rank 0 listens on MASTER_PORT; every other rank connects (retrying until the deadline) and sends a
// hello frame (magic, protocol version, rank, world, its job's run id). Rank 0 checks them all, then answers each
// with a welcome frame carrying the job's nonce, or with an abort frame carrying the reason when something is wrong,
// so every rank fails with the same explanation. A hello of another run id (TORCHELASTIC_RUN_ID) is another job's:
// that process alone is refused (a refuse frame says why) and the rendezvous goes on.
//
// The port stays held while the job lives: after the rendezvous rank 0 keeps listening, and a thread of its own (the
// doorman) answers every process that connects with a refuse frame naming the job that holds the port. Two jobs
// without a run id cannot be told apart by their hellos; a process claiming a rank this job already has, or a second
// rank 0, within the rendezvous window (rank 0's start + the timeout, when a rank of this job could still be coming)
// means a rank of this job may be another job's: the job is stopped on every rank (the doorman sends every rank the
// abort, which they see at their next collective or check_alive) and the newcomer is told so. Later ones are only
// refused. Every later frame carries the job's nonce, checked both ways.
//
// Collectives: every rank sends rank 0 a request frame (op, sequence number, sizes, root, plus its data) and waits
// for the reply; rank 0 checks that all requests match its own call, then replies (allgather: the whole buffer;
// broadcast: the root's data; barrier: nothing). All I/O is non-blocking under poll() with a deadline. Rank 0
// watches every connection, so a rank that dies is named at once; rank 0 then sends the reason to every other rank
// and closes, so nobody waits for the timeout.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bootstrap/bootstrap_util.hpp"
#include "core/interrupt.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;
using detail::BootstrapOp;
using detail::BootstrapOpDesc;
using detail::concat;
using detail::describe;
using detail::describe_duration;
using detail::describe_ranks;

constexpr uint32_t kMagic = 0x31595246;  // "FRY1" in little-endian memory order
constexpr uint32_t kProtocolVersion = 2;
// Control frames; collective frames use the BootstrapOp values (1..3).
constexpr uint32_t kHelloFrame = 0x10;
constexpr uint32_t kWelcomeFrame = 0x11;
constexpr uint32_t kAbortFrame = 0x12;
constexpr uint32_t kRefuseFrame = 0x13;  // to a process that is not part of this job (another job's, or a stranger)
constexpr uint32_t kStopFrame = 0x14;    // an abort that stops the job's calls too (a clash on the port)
// NOTE: an abort carries a one-line reason; anything longer is a corrupt stream, not a message.
constexpr std::size_t kMaxAbortText = 64 * 1024;
// How long rank 0 tries to deliver the abort reason before closing anyway.
constexpr std::chrono::milliseconds kAbortFlushTime{300};
constexpr std::chrono::milliseconds kMaxConnectBackoff{500};
// How long the doorman waits for a newcomer's hello, and rank 0 whose port is taken for the holder's answer.
constexpr std::chrono::milliseconds kDoormanHelloTime{2000};
// How often check_alive looks at the connection to rank 0 (a non-blocking peek; callers check on every call).
constexpr std::chrono::milliseconds kAliveCheckInterval{100};

// Every frame starts with this header (host byte order: the ranks of a job run the same build on the same kind of
// machine; a different byte order shows up as a bad magic).
struct FrameHeader {
  uint32_t magic = kMagic;
  uint32_t kind = 0;
  uint32_t version = kProtocolVersion;
  int32_t rank = -1;           // sender
  int32_t world = 0;           // sender's world size
  int32_t root = -1;           // broadcast root, else -1
  uint64_t seq = 0;            // collective sequence number
  uint64_t op_bytes = 0;       // the call's byte count (allgather: per rank)
  uint64_t payload_bytes = 0;  // bytes that follow this header
  uint64_t job = 0;            // the job's nonce, drawn by rank 0 (0 in a hello: not known yet)
  uint64_t run_id = 0;         // run_id_hash of the sender's SocketBootstrapOptions::run_id (0: none)
};
static_assert(sizeof(FrameHeader) == 64, "the frame header is part of the wire protocol");
// The fields every version starts with: enough to tell another version's hello before its header is complete.
constexpr std::size_t kVersionedPrefix = offsetof(FrameHeader, rank);

char const* frame_name(uint32_t kind) {
  switch (kind) {
    case static_cast<uint32_t>(BootstrapOp::kAllgather):
      return "allgather";
    case static_cast<uint32_t>(BootstrapOp::kBroadcast):
      return "broadcast";
    case static_cast<uint32_t>(BootstrapOp::kBarrier):
      return "barrier";
    case kHelloFrame:
      return "hello";
    case kWelcomeFrame:
      return "welcome";
    case kAbortFrame:
      return "abort";
    case kRefuseFrame:
      return "refuse";
    case kStopFrame:
      return "stop";
  }
  return "unknown frame";
}

// The call a collective frame describes.
BootstrapOpDesc frame_desc(FrameHeader const& header) {
  return {static_cast<BootstrapOp>(header.kind), static_cast<std::size_t>(header.op_bytes), header.root};
}

bool is_collective_frame(uint32_t kind) {
  return kind >= static_cast<uint32_t>(BootstrapOp::kAllgather) && kind <= static_cast<uint32_t>(BootstrapOp::kBarrier);
}

// ---- sockets and deadlines -----------------------------------------------------------------------------------

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Socket& operator=(Socket&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Socket() { close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Deadline {
  Clock::time_point at;

  bool passed() const { return Clock::now() >= at; }
  // Milliseconds left for poll(), rounded up so poll never returns before the deadline.
  int poll_ms() const {
    auto const left = std::chrono::ceil<std::chrono::milliseconds>(at - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
  }
};

// poll() that resumes after signals. Returns the number of ready descriptors (0 on timeout). With an interrupt check
// set (include/ferry/interrupt.hpp) it polls in slices and throws Interrupted when the check asks.
int poll_until(std::vector<pollfd>& fds, Deadline const& deadline) {
  while (true) {
    bool const checking = detail::interrupt_check_set();
    int const slice_ms =
        checking ? std::min<int>(deadline.poll_ms(), detail::kInterruptPoll.count()) : deadline.poll_ms();
    int const ready = ::poll(fds.data(), fds.size(), slice_ms);
    if (ready > 0 || (ready == 0 && deadline.passed())) return ready;
    if (ready < 0 && errno != EINTR)
      FERRY_THROW(BootstrapError, "bootstrap", "poll() failed: ", std::strerror(errno), "; this is a system error");
    if (checking && detail::interrupt_requested())
      FERRY_THROW(Interrupted, "bootstrap",
                  "a bootstrap wait was interrupted (a signal: KeyboardInterrupt in Python); this bootstrap is "
                  "unusable, and the other ranks are told (rank 0) or see this rank leave");
  }
}

void set_socket_options(int fd) {
  // NOTE: small request/reply frames; Nagle plus delayed ACKs would add ~40 ms to every collective.
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int const flags = fcntl(fd, F_GETFL, 0);
  if (flags >= 0) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// What a non-blocking read or write step ended with.
enum class Io { kDone, kPending, kClosed };

// Reads into [buf + got, buf + len) until done or nothing more is available. kClosed: the peer closed or reset
// the connection (error says how).
Io read_some(int fd, char* buf, std::size_t len, std::size_t& got, std::string& error) {
  while (got < len) {
    ssize_t const n = ::recv(fd, buf + got, len - got, 0);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
    } else if (n == 0) {
      error = "EOF";
      return Io::kClosed;
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return Io::kPending;
    } else {
      error = std::strerror(errno);
      return Io::kClosed;
    }
  }
  return Io::kDone;
}

// A frame being sent: header then payload, resumable.
struct Outgoing {
  FrameHeader header;
  std::string owned_payload;  // abort text
  char const* payload = nullptr;
  std::size_t sent = 0;
  bool active = false;  // queued and not finished

  void start(FrameHeader const& frame_header, void const* data) {
    header = frame_header;
    payload = static_cast<char const*>(data);
    sent = 0;
    active = true;
  }
  std::size_t total() const { return sizeof(FrameHeader) + header.payload_bytes; }
  bool mid_frame() const { return active && sent > 0; }
};

// Writes as much of out as the socket takes (MSG_NOSIGNAL: a closed peer is an error, never SIGPIPE).
Io write_some(int fd, Outgoing& out, std::string& error) {
  while (out.sent < out.total()) {
    iovec parts[2];
    int num_parts = 0;
    if (out.sent < sizeof(FrameHeader)) {
      parts[num_parts++] = {reinterpret_cast<char*>(&out.header) + out.sent, sizeof(FrameHeader) - out.sent};
      if (out.header.payload_bytes > 0)
        parts[num_parts++] = {const_cast<char*>(out.payload), static_cast<std::size_t>(out.header.payload_bytes)};
    } else {
      std::size_t const done = out.sent - sizeof(FrameHeader);
      parts[num_parts++] = {const_cast<char*>(out.payload) + done, out.header.payload_bytes - done};
    }
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = num_parts;
    ssize_t const n = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      out.sent += static_cast<std::size_t>(n);
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return Io::kPending;
    } else {
      error = std::strerror(errno);
      return Io::kClosed;
    }
  }
  out.active = false;
  return Io::kDone;
}

// A frame being received: header first, then a payload whose destination is chosen once the header is checked.
struct Incoming {
  FrameHeader header;
  std::size_t header_got = 0;
  char* payload = nullptr;
  std::size_t payload_len = 0;
  std::size_t payload_got = 0;
  bool header_checked = false;
  bool done = false;

  void reset() { *this = Incoming{}; }
  bool header_complete() const { return header_got == sizeof(FrameHeader); }
};

// Advances in: reads the header, lets on_header check it and pick the payload destination (it may throw), reads
// the payload.
template <typename OnHeader>
Io read_frame(int fd, Incoming& in, std::string& error, OnHeader&& on_header) {
  if (!in.header_complete()) {
    Io const io = read_some(fd, reinterpret_cast<char*>(&in.header), sizeof(FrameHeader), in.header_got, error);
    if (io != Io::kDone) return io;
  }
  if (!in.header_checked) {
    on_header(in);
    in.header_checked = true;
  }
  Io const io = read_some(fd, in.payload, in.payload_len, in.payload_got, error);
  if (io == Io::kDone) in.done = true;
  return io;
}

// What a connection that should be silent (its peer waits for us) turned out to hold when it became readable.
enum class Silent { kQuiet, kData, kClosed };

Silent check_silent(int fd, std::string& error) {
  char byte;
  ssize_t const n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return Silent::kData;
  if (n == 0) {
    error = "EOF";
    return Silent::kClosed;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Silent::kQuiet;
  error = std::strerror(errno);
  return Silent::kClosed;
}

// Closes a connection without destroying data the peer has not read yet: FIN after what was sent, then drop what
// the peer sent us (unread data at close() would turn the FIN into a reset).
void close_gracefully(Socket& socket) {
  if (!socket.valid()) return;
  ::shutdown(socket.fd(), SHUT_WR);
  char sink[4096];
  while (::recv(socket.fd(), sink, sizeof(sink), MSG_DONTWAIT) > 0) {
  }
  socket.close();
}

std::string endpoint(std::string const& addr, int port) {
  return addr.find(':') != std::string::npos ? concat("[", addr, "]:", port) : concat(addr, ":", port);
}

// FNV-1a of a run id; 0 for none (a run id that hashes to 0 is taken as 1).
uint64_t run_id_hash(std::string const& run_id) {
  if (run_id.empty()) return 0;
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char const c : run_id) hash = (hash ^ c) * 0x100000001b3ull;
  return hash == 0 ? 1 : hash;
}

std::string run_id_text(std::string const& run_id) {
  return run_id.empty() ? std::string("TORCHELASTIC_RUN_ID unset") : concat("TORCHELASTIC_RUN_ID=", run_id);
}

// What to do when the port is another job's: the same advice wherever the clash is found.
constexpr char kPickAPort[] =
    "give each job its own MASTER_PORT (`ferry launch` and `python -m ferry.launch` pick a free one when MASTER_PORT "
    "is "
    "unset; torchrun: --master-port or --rdzv-endpoint), or a TORCHELASTIC_RUN_ID of its own";

// Sends one small frame (header + text) within kAbortFlushTime, best effort: the peer may be gone or not reading.
void send_briefly(Socket& socket, FrameHeader header, std::string const& text) {
  if (!socket.valid()) return;
  header.payload_bytes = std::min(text.size(), kMaxAbortText);
  Outgoing out;
  out.start(header, text.data());
  Deadline const deadline{Clock::now() + kAbortFlushTime};
  while (!deadline.passed()) {
    std::string error;
    if (write_some(socket.fd(), out, error) != Io::kPending) break;
    pollfd fd{socket.fd(), POLLOUT, 0};
    ::poll(&fd, 1, deadline.poll_ms());
  }
  close_gracefully(socket);
}

// A listening TCP socket on `port`, every interface (dual-stack IPv6 when there is one); -1 with errno set on failure.
int listen_any(int port) {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool const ipv6 = fd >= 0;
  if (!ipv6) fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (ipv6) {
    int zero = 0;
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  if (rc != 0 || ::listen(fd, SOMAXCONN) != 0) {
    int const error = errno;
    ::close(fd);
    errno = error;
    return -1;
  }
  set_socket_options(fd);
  return fd;
}

// Rank 0 found its port taken: asks the holder (on this host) who it is, as a rank 0 saying hello. A Ferry job's rank
// 0 answers with why this process cannot join it; "" when nothing Ferry answers within kDoormanHelloTime.
std::string ask_port_holder(int port, FrameHeader const& hello) {
  Socket socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket.valid()) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(socket.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return "";
  set_socket_options(socket.fd());
  Outgoing out;
  out.start(hello, nullptr);
  Incoming in;
  std::string text;
  Deadline const deadline{Clock::now() + kDoormanHelloTime};
  while (!in.done && !deadline.passed()) {
    std::string error;
    if (out.active && write_some(socket.fd(), out, error) == Io::kClosed) out.active = false;
    Io const io = read_frame(socket.fd(), in, error, [&](Incoming& frame) {
      bool const answer = frame.header.magic == kMagic &&
                          (frame.header.kind == kRefuseFrame || frame.header.kind == kAbortFrame) &&
                          frame.header.payload_bytes <= kMaxAbortText;
      text.resize(answer ? frame.header.payload_bytes : 0);
      frame.payload = text.data();
      frame.payload_len = text.size();
      if (!answer) frame.header.kind = 0;
    });
    if (io == Io::kClosed) break;
    pollfd fd{socket.fd(), static_cast<short>(POLLIN | (out.active ? POLLOUT : 0)), 0};
    ::poll(&fd, 1, deadline.poll_ms());
  }
  return in.done && in.header.kind != 0 ? text : std::string();
}

// ---- the bootstrap ---------------------------------------------------------------------------------------------

// One connection of rank 0 to a peer rank.
struct Peer {
  Socket socket;
  int rank = -1;
  Incoming in;
  Outgoing out;
};

class SocketBootstrap final : public Bootstrap {
 public:
  explicit SocketBootstrap(SocketBootstrapOptions const& options)
      : options_(options),
        // NOTE: a non-zero rank waits this much longer than rank 0 for rank 0's verdict, so that when a rank is
        // missing rank 0 (who knows which one) tells everybody before their own deadline passes.
        master_grace_(std::clamp<std::chrono::milliseconds>(options.timeout / 2, std::chrono::milliseconds(200),
                                                            std::chrono::milliseconds(5000))) {
    if (options_.world == 1) return;  // nobody to meet
    if (options_.rank == 0) {
      std::random_device device;
      while (job_ == 0) job_ = (static_cast<uint64_t>(device()) << 32) ^ device();
      master_rendezvous();
    } else {
      worker_rendezvous();
    }
  }

  // Sockets close through their destructors; the doorman is told to stop and joined. Nothing here can throw.
  ~SocketBootstrap() override {
    if (!doorman_.joinable()) return;
    char const stop = 's';
    [[maybe_unused]] ssize_t const n = ::write(stop_pipe_[1], &stop, 1);
    doorman_.join();
    for (int fd : {stop_pipe_[0], stop_pipe_[1], wake_pipe_[0], wake_pipe_[1]}) ::close(fd);
  }

  int rank() const override { return options_.rank; }
  int world() const override { return options_.world; }
  int local_rank() const override { return options_.local_rank; }
  int local_world() const override { return options_.local_world; }

  void allgather(void const* send, void* recv, std::size_t bytes) override {
    FERRY_CHECK_INPUT(bytes == 0 || (send && recv), "bootstrap allgather of ", bytes, " bytes needs non-null buffers");
    collective({BootstrapOp::kAllgather, bytes, -1}, send, recv);
  }

  void broadcast(void* data, std::size_t bytes, int root) override {
    FERRY_CHECK_INPUT(root >= 0 && root < options_.world, "bootstrap broadcast root=", root, " is outside [0, ",
                      options_.world, ")");
    FERRY_CHECK_INPUT(bytes == 0 || data, "bootstrap broadcast of ", bytes, " bytes needs a non-null buffer");
    collective({BootstrapOp::kBroadcast, bytes, root}, data, data);
  }

  void barrier() override { collective({BootstrapOp::kBarrier, 0, -1}, nullptr, nullptr); }

  void check_alive() override {
    if (options_.world == 1) return;
    if (options_.rank == 0) {
      if (std::string const clash = stopped(); !clash.empty()) {
        std::lock_guard<std::mutex> const lock(peers_mutex_);
        abort_job(clash, kStopFrame);
      }
      return;
    }
    if (!stop_text_.empty()) FERRY_THROW(BootstrapError, "bootstrap", stop_text_);
    // NOTE: between collectives rank 0 sends nothing but an abort; a closed connection is not an error here (rank 0
    // may be gone while the others go on without it, rank masking), the next collective reports it
    auto const now = Clock::now();
    if (!master_.valid() || now < next_alive_check_) return;
    next_alive_check_ = now + kAliveCheckInterval;
    char byte;
    if (::recv(master_.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) != 1) return;
    Outgoing idle;
    Incoming in;
    exchange_with_master(idle, in, Deadline{Clock::now() + kAbortFlushTime}, "nothing (between collectives)",
                         [&](Incoming& frame) {
                           fail(concat("rank 0 (master) sent a ", frame_name(frame.header.kind),
                                       " frame between collectives; the stream is corrupt"));
                         });
  }

 private:
  std::string master_endpoint() const { return endpoint(options_.master_addr, options_.master_port); }

  void collective(BootstrapOpDesc const& desc, void const* send, void* recv) {
    uint64_t const seq = next_seq_++;
    if (options_.rank == 0 && options_.world > 1 && failure_.empty()) {
      std::lock_guard<std::mutex> const lock(peers_mutex_);
      if (std::string const clash = stopped(); !clash.empty()) abort_job(clash, kStopFrame);
    }
    if (!failure_.empty())
      FERRY_THROW(BootstrapError, "bootstrap", "rank ", options_.rank, " called ", describe(desc), " (operation #", seq,
                  ") on a bootstrap that already failed: ", failure_);
    if (options_.world == 1) {
      if (desc.op == BootstrapOp::kAllgather && desc.bytes > 0 && send != recv) std::memmove(recv, send, desc.bytes);
      return;
    }
    try {
      if (options_.rank == 0)
        master_collective(desc, seq, send, recv);
      else
        worker_collective(desc, seq, send, recv);
    } catch (Interrupted const& interrupted) {
      // this rank left the operation midway: it fails for good, and rank 0 tells the others why
      failure_ = concat("rank ", options_.rank, " was interrupted in ", describe(desc), " (operation #", seq, ")");
      if (options_.rank == 0) {
        std::lock_guard<std::mutex> const lock(peers_mutex_);
        send_abort(failure_);
      } else {
        master_.close();
      }
      throw;
    }
  }

  FrameHeader make_header(uint32_t kind) const {
    FrameHeader header;
    header.kind = kind;
    header.rank = options_.rank;
    header.world = options_.world;
    header.job = job_;
    header.run_id = run_id_hash(options_.run_id);
    return header;
  }

  // ---- rank 0 ----

  void master_rendezvous() {
    listener_ = listen_on_master_port();
    listen_start_ = Clock::now();
    Deadline const deadline{listen_start_ + options_.timeout};
    peers_.resize(options_.world);
    struct Pending {
      Socket socket;
      Incoming in;
    };
    std::vector<Pending> pending;  // accepted, hello not complete yet
    int num_joined = 0;

    // 1. accept connections and read hellos until every rank has joined
    while (num_joined < options_.world - 1) {
      std::vector<pollfd> fds;
      fds.push_back({listener_.fd(), POLLIN, 0});
      for (auto const& connection : pending) fds.push_back({connection.socket.fd(), POLLIN, 0});
      std::vector<int> joined_ranks;
      for (auto const& peer : peers_)
        if (peer.socket.valid()) {
          fds.push_back({peer.socket.fd(), POLLIN, 0});
          joined_ranks.push_back(peer.rank);
        }
      if (poll_until(fds, deadline) == 0) {
        std::vector<int> missing;
        for (int r = 1; r < options_.world; ++r)
          if (!peers_[r].socket.valid()) missing.push_back(r);
        std::vector<int> present = {0};
        present.insert(present.end(), joined_ranks.begin(), joined_ranks.end());
        abort_job(concat(describe_ranks(missing), " did not connect to rank 0 (master) at ", master_endpoint(),
                         " within ", describe_duration(options_.timeout), " (present: ", describe_ranks(present),
                         "); check that all ", options_.world,
                         " ranks were started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE=", options_.world,
                         ", and that they can reach this host (raise FERRY_BOOTSTRAP_TIMEOUT_S if they start slowly)"));
      }
      // joined ranks send nothing before the welcome: readable means it closed (died)
      std::size_t const first_joined = 1 + pending.size();
      for (std::size_t i = 0; i < joined_ranks.size(); ++i)
        if (fds[first_joined + i].revents) check_joined_silent(joined_ranks[i]);
      // hellos of pending connections
      for (std::size_t i = 0; i < pending.size(); ++i) {
        if (!fds[1 + i].revents) continue;
        std::string error;
        Incoming& in = pending[i].in;
        Io const io = read_some(pending[i].socket.fd(), reinterpret_cast<char*>(&in.header), sizeof(FrameHeader),
                                in.header_got, error);
        if (io == Io::kClosed) pending[i].socket.close();  // left before saying who it is: not a rank
        // another version's hello (or a stranger's bytes) may be shorter: the first words tell
        bool const other_version =
            in.header_got >= kVersionedPrefix &&
            (in.header.magic != kMagic || in.header.kind != kHelloFrame || in.header.version != kProtocolVersion);
        if (io != Io::kDone && !other_version) continue;
        FrameHeader const hello = in.header;
        Socket socket = std::move(pending[i].socket);
        if (!other_version && is_other_job(hello)) {
          // another job's rank (its run id differs): it alone is refused, this job's rendezvous goes on
          send_briefly(socket, make_header(kRefuseFrame), holder_text(hello, "is meeting its ranks"));
          continue;
        }
        if (std::string const problem = check_hello(hello); !problem.empty()) {
          rejected_ = std::move(socket);  // it gets the reason too
          abort_job(problem);
        }
        peers_[hello.rank].socket = std::move(socket);
        peers_[hello.rank].rank = hello.rank;
        ++num_joined;
      }
      std::erase_if(pending, [](Pending const& connection) { return !connection.socket.valid(); });
      // new connections
      if (fds[0].revents & POLLIN) {
        while (true) {
          int const fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
          if (fd < 0) break;
          set_socket_options(fd);
          pending.push_back({Socket(fd), {}});
        }
      }
    }

    // 2. welcome everybody (with the job's nonce), then keep the port: the doorman answers whoever comes next
    met_at_ = Clock::now();
    for (int r = 1; r < options_.world; ++r) peers_[r].out.start(make_header(kWelcomeFrame), nullptr);
    flush_replies(deadline, "the end of the rendezvous");
    start_doorman();
  }

  // A joined rank's connection became readable before the welcome: it closed (died) or is not a Ferry rank.
  void check_joined_silent(int peer_rank) {
    std::string error;
    Silent const state = check_silent(peers_[peer_rank].socket.fd(), error);
    if (state == Silent::kQuiet) return;
    if (state == Silent::kClosed) {
      peers_[peer_rank].socket.close();
      abort_job(concat("rank ", peer_rank, " connected and then closed its connection (", error,
                       ") before all ranks arrived; it probably failed or died: see its output"));
    }
    abort_job(concat("rank ", peer_rank,
                     " sent data before the rendezvous completed; it is not speaking the Ferry bootstrap protocol of "
                     "this build"));
  }

  // A well-formed hello of another run id: another job's rank.
  bool is_other_job(FrameHeader const& hello) const {
    return hello.magic == kMagic && hello.kind == kHelloFrame && hello.version == kProtocolVersion &&
           hello.run_id != run_id_hash(options_.run_id);
  }

  // What a process that cannot join is told of the job holding the port.
  std::string holder_text(FrameHeader const& hello, char const* doing) const {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    std::string const port = concat("MASTER_PORT=", options_.master_port);
    std::string const who = concat("rank 0 is process ", getpid(), " on ", host, ", WORLD_SIZE=", options_.world, ", ",
                                   run_id_text(options_.run_id));
    std::string const newcomer =
        concat("rank ", hello.rank, " of WORLD_SIZE=", hello.world,
               hello.run_id == run_id_hash(options_.run_id) ? std::string(" with the same run id")
                                                            : std::string(" with another TORCHELASTIC_RUN_ID"));
    return concat(port, " is held by another Ferry job, which ", doing, " (", who, "); this process (", newcomer,
                  ") is not part of it: ", kPickAPort);
  }

  // Problem with a hello of this job's run id, "" if it is fine.
  std::string check_hello(FrameHeader const& hello) const {
    std::string const port = std::to_string(options_.master_port);
    if (hello.magic != kMagic || hello.kind != kHelloFrame)
      return concat("a process connected to MASTER_PORT=", port, " that is not a Ferry rank (bad hello: magic 0x",
                    std::hex, hello.magic, std::dec, ", frame ", hello.kind,
                    "); another job or program may be using the same MASTER_ADDR/MASTER_PORT: pick a free port");
    if (hello.version != kProtocolVersion)
      return concat("rank ", hello.rank, " speaks bootstrap protocol version ", hello.version, " but rank 0 speaks ",
                    kProtocolVersion, "; run the same Ferry build on every rank");
    if (hello.world != options_.world)
      return concat("rank ", hello.rank, " was started with WORLD_SIZE=", hello.world,
                    " but rank 0 has WORLD_SIZE=", options_.world, "; start every rank with the same WORLD_SIZE");
    if (hello.rank == 0)
      return concat(
          "a second process connected as rank 0 (RANK=0 twice, or another job's rank 0 on the same "
          "MASTER_PORT); give every process a distinct RANK in [0, ",
          options_.world, ") and each job its own MASTER_PORT");
    if (hello.rank < 0 || hello.rank >= options_.world)
      return concat("a process connected as rank ", hello.rank, " but WORLD_SIZE=", options_.world, " (ranks 0..",
                    options_.world - 1, "); check RANK and WORLD_SIZE");
    if (peers_[hello.rank].socket.valid())
      return concat("two processes connected as rank ", hello.rank, "; give every process a distinct RANK in [0, ",
                    options_.world, ") (or another job with the same MASTER_PORT is starting: ", kPickAPort, ")");
    return "";
  }

  Socket listen_on_master_port() {
    // Listen on every interface (as torchrun's store does): MASTER_ADDR is how the others reach this host, and
    // may be a name or address this process cannot bind. Dual-stack IPv6 takes IPv4 too; plain IPv4 otherwise.
    int const fd = listen_any(options_.master_port);
    if (fd >= 0) return Socket(fd);
    int const error = errno;
    if (error != EADDRINUSE)
      FERRY_THROW(BootstrapError, "bootstrap", "rank 0 could not listen on port ", options_.master_port, ": ",
                  std::strerror(error), "; check MASTER_PORT");
    // the port is taken: a Ferry job's rank 0 says which job holds it
    FrameHeader hello = make_header(kHelloFrame);
    hello.job = 0;
    if (std::string const holder = ask_port_holder(options_.master_port, hello); !holder.empty())
      FERRY_THROW(BootstrapError, "bootstrap", "rank 0 could not listen on MASTER_PORT=", options_.master_port,
                  " for this job (WORLD_SIZE=", options_.world, ", ", run_id_text(options_.run_id), "): ", holder);
    FERRY_THROW(BootstrapError, "bootstrap", "rank 0 could not listen on port ", options_.master_port, ": ",
                std::strerror(error),
                "; another process (another job, or an earlier run still exiting) holds MASTER_PORT: pick another "
                "MASTER_PORT for this job");
  }

  // ---- rank 0 after the rendezvous: the doorman keeps the port ----

  void start_doorman() {
    if (::pipe2(stop_pipe_, O_CLOEXEC) != 0 || ::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0)
      abort_job(concat("rank 0 could not create a pipe for the thread that keeps MASTER_PORT: ", std::strerror(errno)));
    doorman_ = std::thread([this] { doorman_loop(); });
  }

  // The clash that stopped this job ("" while none), set by the doorman.
  std::string stopped() const {
    std::lock_guard<std::mutex> const lock(clash_mutex_);
    return clash_;
  }

  // Answers every process that connects after the rendezvous (each within kDoormanHelloTime of its connect), until
  // the destructor says stop. Touches only the listener, its own connections and the clash (under its mutex); the
  // peers' sockets only under peers_mutex_, to send them the abort.
  void doorman_loop() {
    struct Newcomer {
      Socket socket;
      Incoming in;
      Clock::time_point until;
    };
    std::vector<Newcomer> newcomers;
    while (true) {
      std::vector<pollfd> fds = {{stop_pipe_[0], POLLIN, 0}, {listener_.fd(), POLLIN, 0}};
      for (auto const& n : newcomers) fds.push_back({n.socket.fd(), POLLIN, 0});
      int const wait_ms = newcomers.empty() ? -1 : static_cast<int>(kDoormanHelloTime.count() / 4);
      if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) return;
      if (fds[0].revents) return;
      for (std::size_t i = 0; i < newcomers.size(); ++i) {
        if (!fds[2 + i].revents) continue;
        std::string error;
        Incoming& in = newcomers[i].in;
        Io const io = read_some(newcomers[i].socket.fd(), reinterpret_cast<char*>(&in.header), sizeof(FrameHeader),
                                in.header_got, error);
        if (io == Io::kClosed) newcomers[i].socket.close();
        if (io == Io::kDone || in.header_got >= kVersionedPrefix) answer_newcomer(newcomers[i].socket, in);
      }
      auto const now = Clock::now();
      std::erase_if(newcomers, [&](Newcomer const& n) { return !n.socket.valid() || now > n.until; });
      if (fds[1].revents & POLLIN)
        for (int fd; (fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) {
          set_socket_options(fd);
          newcomers.push_back({Socket(fd), {}, now + kDoormanHelloTime});
        }
    }
  }

  // Tells a newcomer why it cannot join; a newcomer of this job's world and run id claiming rank 0 or a rank this job
  // has, within the rendezvous window, may mean a rank of this job is another job's: the job stops.
  void answer_newcomer(Socket& socket, Incoming const& in) {
    FrameHeader const& hello = in.header;
    bool const complete = in.header_got == sizeof(FrameHeader);
    if (!complete && hello.version == kProtocolVersion) return;  // the rest is coming
    std::string text;
    if (hello.magic != kMagic || hello.kind != kHelloFrame) {
      text = concat("MASTER_PORT=", options_.master_port,
                    " is held by a Ferry job, and this process did not say hello "
                    "as a Ferry rank (magic 0x",
                    std::hex, hello.magic, std::dec, ")");
    } else if (hello.version != kProtocolVersion) {
      text = concat("MASTER_PORT=", options_.master_port, " is held by a Ferry job of bootstrap protocol version ",
                    kProtocolVersion, " (this process speaks ", hello.version, ")");
    } else if (hello.world == options_.world && hello.run_id == run_id_hash(options_.run_id) && hello.rank >= 0 &&
               hello.rank < options_.world && Clock::now() < listen_start_ + options_.timeout) {
      std::string const clash = concat(
          "two jobs share MASTER_PORT=", options_.master_port, ": ",
          describe_duration(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - met_at_)),
          " after this job's ", options_.world, " ranks met, another process of WORLD_SIZE=", hello.world, " and ",
          run_id_text(options_.run_id), " asked to join as rank ", hello.rank,
          hello.rank == 0 ? std::string(" (a second rank 0)") : std::string(", which this job already has"),
          ", before this job's rendezvous window closed; the ranks of two jobs without a run id cannot be told apart, "
          "so a rank of this job may be the other job's, and every rank of this job stops: ",
          kPickAPort);
      stop_job(clash);
      text = clash;
    } else {
      text = holder_text(hello, "is running");
    }
    send_briefly(socket, make_header(kRefuseFrame), text);
  }

  // The doorman found a clash: recorded for rank 0's calls, the collective in progress woken, every rank told.
  void stop_job(std::string const& clash) {
    {
      std::lock_guard<std::mutex> const lock(clash_mutex_);
      if (!clash_.empty()) return;
      clash_ = clash;
    }
    char const wake = 'w';
    [[maybe_unused]] ssize_t const n = ::write(wake_pipe_[1], &wake, 1);
    std::lock_guard<std::mutex> const lock(peers_mutex_);  // after a collective in progress saw the wake and aborted
    send_abort(clash, kStopFrame);
  }

  void master_collective(BootstrapOpDesc const& desc, uint64_t seq, void const* send, void* recv) {
    std::lock_guard<std::mutex> const lock(peers_mutex_);  // the doorman's abort waits for this collective
    Deadline const deadline{Clock::now() + options_.timeout};
    int const world = options_.world;
    char* const out = static_cast<char*>(recv);

    // 1. rank 0's own part (allgather block 0 may alias send)
    if (desc.op == BootstrapOp::kAllgather && desc.bytes > 0 && send != out) std::memmove(out, send, desc.bytes);

    // 2. gather every rank's request, checking it against rank 0's call
    for (int r = 1; r < world; ++r) peers_[r].in.reset();
    auto const on_header = [&](Peer& peer) {
      return [&, seq](Incoming& in) {
        FrameHeader const& header = in.header;
        if (header.magic != kMagic || !is_collective_frame(header.kind))
          abort_job(concat("rank ", peer.rank, " sent a corrupt frame (magic 0x", std::hex, header.magic, std::dec,
                           ", frame ", header.kind, ") instead of its request for ", describe(desc), " (operation #",
                           seq, "); the stream is out of step: check that every rank runs the same Ferry build"));
        if (header.job != job_)
          abort_job(concat("rank ", peer.rank, " sent a request of another job (nonce ", header.job, ", this job's is ",
                           job_, ") for ", describe(desc), " (operation #", seq, "); the stream is corrupt"));
        if (!(frame_desc(header) == desc) || header.seq != seq)
          abort_job(concat("operation #", seq, ": rank ", peer.rank, " called ", describe(frame_desc(header)),
                           header.seq != seq ? concat(" as its operation #", header.seq) : std::string(),
                           " while rank 0 called ", describe(desc),
                           "; every rank must make the same bootstrap calls in the same order"));
        std::size_t expected = 0;
        if (desc.op == BootstrapOp::kAllgather) {
          expected = desc.bytes;
          in.payload = out + static_cast<std::size_t>(peer.rank) * desc.bytes;
        } else if (desc.op == BootstrapOp::kBroadcast && peer.rank == desc.root) {
          expected = desc.bytes;
          in.payload = out;
        }
        if (header.payload_bytes != expected)
          abort_job(concat("rank ", peer.rank, " sent ", header.payload_bytes, " bytes with its ", describe(desc),
                           " (operation #", seq, "), expected ", expected,
                           "; the stream is corrupt: check that every rank runs the same Ferry build"));
        in.payload_len = expected;
      };
    };
    while (true) {
      std::vector<pollfd> fds;
      std::vector<int> fd_rank;
      std::vector<int> missing;
      for (int r = 1; r < world; ++r) {
        // requests done: still watched, so a rank dying while the others are late is named at once
        fds.push_back({peers_[r].socket.fd(), POLLIN, 0});
        fd_rank.push_back(r);
        if (!peers_[r].in.done) missing.push_back(r);
      }
      if (missing.empty()) break;
      if (poll_peers(fds, deadline) == 0)
        abort_job(concat(describe_ranks(missing), " did not arrive at ", describe(desc), " (operation #", seq,
                         ") within ", describe_duration(options_.timeout),
                         "; check that every rank makes the same bootstrap calls in the same order and that none is "
                         "stuck or much slower (FERRY_BOOTSTRAP_TIMEOUT_S sets the limit)"));
      for (std::size_t i = 0; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        Peer& peer = peers_[fd_rank[i]];
        std::string error;
        bool closed = false;
        if (peer.in.done) {
          Silent const state = check_silent(peer.socket.fd(), error);
          if (state == Silent::kQuiet) continue;
          closed = state == Silent::kClosed;
          if (!closed)
            abort_job(concat("rank ", peer.rank, " sent data out of turn during ", describe(desc), " (operation #", seq,
                             "); the stream is corrupt: check that every rank runs the same Ferry build"));
        } else {
          closed = read_frame(peer.socket.fd(), peer.in, error, on_header(peer)) == Io::kClosed;
        }
        if (closed) {
          char const* const when = peer.in.done ? "after" : peer.in.header_got > 0 ? "while" : "before";
          peer.socket.close();
          abort_job(concat("rank ", peer.rank, " closed its connection (", error, ") during ", describe(desc),
                           " (operation #", seq, "), ", when,
                           " sending its request; it probably failed or died: see its output"));
        }
      }
    }

    // 3. reply: allgather the whole buffer, broadcast the root's data (the root has it), barrier nothing
    for (int r = 1; r < world; ++r) {
      FrameHeader header = make_header(static_cast<uint32_t>(desc.op));
      header.seq = seq;
      header.op_bytes = desc.bytes;
      header.root = desc.root;
      if (desc.op == BootstrapOp::kAllgather) header.payload_bytes = world * desc.bytes;
      if (desc.op == BootstrapOp::kBroadcast && r != desc.root) header.payload_bytes = desc.bytes;
      peers_[r].out.start(header, desc.op == BootstrapOp::kBroadcast && desc.root == 0 ? send : out);
    }
    flush_replies(deadline, concat("the result of ", describe(desc), " (operation #", seq, ")"));
  }

  // poll_until over the peers' connections and the doorman's wake: a clash it found ends the collective at once.
  int poll_peers(std::vector<pollfd>& fds, Deadline const& deadline) {
    fds.push_back({wake_pipe_[0], POLLIN, 0});  // -1 (ignored) before the doorman starts
    int ready = poll_until(fds, deadline);
    if (fds.back().revents) abort_job(stopped(), kStopFrame);
    fds.pop_back();
    return ready;
  }

  // Sends every queued frame to its peer before the deadline.
  void flush_replies(Deadline const& deadline, std::string const& what) {
    while (true) {
      std::vector<pollfd> fds;
      std::vector<int> fd_rank;
      for (int r = 1; r < options_.world; ++r) {
        if (!peers_[r].out.active) continue;
        std::string error;
        Io const io = write_some(peers_[r].socket.fd(), peers_[r].out, error);
        if (io == Io::kClosed) {
          peers_[r].socket.close();
          abort_job(concat("rank ", r, " closed its connection (", error, ") while rank 0 sent it ", what,
                           "; it probably failed or died: see its output"));
        }
        if (io == Io::kPending) {
          fds.push_back({peers_[r].socket.fd(), POLLOUT, 0});
          fd_rank.push_back(r);
        }
      }
      if (fds.empty()) return;
      if (poll_peers(fds, deadline) == 0)
        abort_job(concat(describe_ranks(fd_rank), " did not take ", what, " within ",
                         describe_duration(options_.timeout), "; those ranks are stuck or much slower"));
    }
  }

  // Rank 0 gives up: records why, tells every rank it can reach the same reason, and throws. kind: kAbortFrame, or
  // kStopFrame for a clash (its ranks then refuse their calls too: check_alive).
  [[noreturn]] void abort_job(std::string const& reason, uint32_t kind = kAbortFrame) {
    failure_ = reason;
    send_abort(reason, kind);
    FERRY_THROW(BootstrapError, "bootstrap", reason);
  }

  // Tells every rank it can reach the reason (after finishing a reply already half sent, which the rank must read
  // first) and closes everything so nobody waits for the timeout. The caller holds peers_mutex_ once the doorman runs.
  void send_abort(std::string const& reason, uint32_t kind = kAbortFrame) {
    std::string const text = reason.substr(0, kMaxAbortText);
    struct Target {
      Socket* socket;
      std::vector<Outgoing> frames;  // sent in order
    };
    std::vector<Target> targets;
    auto const add_target = [&](Socket& socket, Outgoing const* unfinished) {
      if (!socket.valid()) return;
      Target target{&socket, {}};
      if (unfinished) target.frames.push_back(*unfinished);
      FrameHeader header = make_header(kind);
      header.payload_bytes = text.size();
      Outgoing abort;
      abort.start(header, text.data());
      target.frames.push_back(abort);
      targets.push_back(std::move(target));
    };
    for (auto& peer : peers_) add_target(peer.socket, peer.out.mid_frame() ? &peer.out : nullptr);
    add_target(rejected_, nullptr);
    // best effort, briefly: a rank that does not read in time gets the close instead
    Deadline const deadline{Clock::now() + kAbortFlushTime};
    while (true) {
      std::vector<pollfd> fds;
      for (auto& target : targets) {
        while (!target.frames.empty()) {
          std::string error;
          Io const io = write_some(target.socket->fd(), target.frames.front(), error);
          if (io == Io::kClosed) target.frames.clear();
          if (io == Io::kPending) break;
          if (io == Io::kDone) target.frames.erase(target.frames.begin());
        }
        if (!target.frames.empty()) fds.push_back({target.socket->fd(), POLLOUT, 0});
      }
      if (fds.empty() || deadline.passed()) break;
      ::poll(fds.data(), fds.size(), deadline.poll_ms());
    }
    for (auto& peer : peers_) close_gracefully(peer.socket);
    close_gracefully(rejected_);
  }

  // ---- ranks 1..world-1 ----

  void worker_rendezvous() {
    Deadline const connect_deadline{Clock::now() + options_.timeout};
    master_ = connect_to_master(connect_deadline);
    // rank 0 decides within its own timeout, which started before this connection was accepted
    Deadline const verdict_deadline{Clock::now() + options_.timeout + master_grace_};

    Outgoing hello;
    hello.start(make_header(kHelloFrame), nullptr);
    Incoming in;
    std::string const what = "the end of the rendezvous";
    exchange_with_master(hello, in, verdict_deadline, what, [&](Incoming& frame) {
      if (frame.header.magic != kMagic)
        fail(concat("the process at ", master_endpoint(), " is not rank 0 of a Ferry job (bad magic 0x", std::hex,
                    frame.header.magic, std::dec,
                    "); check that MASTER_ADDR/MASTER_PORT name rank 0 of this job and no other program uses that "
                    "port"));
      if (frame.header.kind != kWelcomeFrame || frame.header.job == 0)
        fail(concat("rank 0 (master) answered the hello with a ", frame_name(frame.header.kind),
                    " frame; the stream is corrupt: check that every rank runs the same Ferry build"));
      // NOTE: rank 0 refuses another run id's hello; a welcome of another run id is a rank 0 of another build
      if (frame.header.run_id != run_id_hash(options_.run_id))
        fail(concat("rank 0 at ", master_endpoint(), " welcomed this rank into a job of another run id than ",
                    run_id_text(options_.run_id), "; ", kPickAPort));
      job_ = frame.header.job;
    });
  }

  Socket connect_to_master(Deadline const& deadline) {
    std::string const port = std::to_string(options_.master_port);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    auto backoff = std::chrono::milliseconds(10);
    std::string last_error = "no attempt made";
    while (true) {
      // 1. resolve MASTER_ADDR (again on every round: a name may appear while the job starts)
      addrinfo* found = nullptr;
      int const gai = ::getaddrinfo(options_.master_addr.c_str(), port.c_str(), &hints, &found);
      if (gai != 0) {
        last_error = concat("cannot resolve MASTER_ADDR=", options_.master_addr, ": ", ::gai_strerror(gai));
      } else {
        // 2. try each address; refused means rank 0 is not listening yet
        for (addrinfo* ai = found; ai; ai = ai->ai_next) {
          Socket socket(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
          if (!socket.valid()) {
            last_error = std::strerror(errno);
            continue;
          }
          int error = 0;
          if (::connect(socket.fd(), ai->ai_addr, ai->ai_addrlen) != 0) {
            error = errno;
            if (error == EINPROGRESS) {
              std::vector<pollfd> fds = {{socket.fd(), POLLOUT, 0}};
              if (poll_until(fds, deadline) == 0) {
                error = ETIMEDOUT;
              } else {
                socklen_t len = sizeof(error);
                getsockopt(socket.fd(), SOL_SOCKET, SO_ERROR, &error, &len);
              }
            }
          }
          if (error == 0 && is_self_connection(socket.fd())) error = ECONNREFUSED;
          if (error == 0) {
            ::freeaddrinfo(found);
            set_socket_options(socket.fd());
            return socket;
          }
          last_error = std::strerror(error);
        }
        ::freeaddrinfo(found);
      }
      // 3. back off and retry until the deadline
      if (deadline.passed())
        fail(concat("rank ", options_.rank, " could not connect to rank 0 (master) at ", master_endpoint(), " within ",
                    describe_duration(options_.timeout), " (last error: ", last_error,
                    "); check that MASTER_ADDR/MASTER_PORT name rank 0's host and port, that rank 0 was started and "
                    "that no firewall blocks the port (raise FERRY_BOOTSTRAP_TIMEOUT_S if rank 0 starts slowly)"));
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline.at - Clock::now()));
      if (detail::interrupt_requested())
        FERRY_THROW(Interrupted, "bootstrap", "rank ", options_.rank,
                    " was interrupted while connecting to rank 0 (master) at ", master_endpoint(),
                    " (a signal: KeyboardInterrupt in Python)");
      backoff = std::min(backoff * 2, kMaxConnectBackoff);
    }
  }

  // Connecting to a local port nobody listens on can, in the ephemeral port range, connect the socket to itself
  // (TCP simultaneous open); that is not rank 0.
  static bool is_self_connection(int fd) {
    sockaddr_storage self{}, peer{};
    socklen_t self_len = sizeof(self), peer_len = sizeof(peer);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_len) != 0) return false;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) return false;
    return self_len == peer_len && std::memcmp(&self, &peer, self_len) == 0;
  }

  void worker_collective(BootstrapOpDesc const& desc, uint64_t seq, void const* send, void* recv) {
    Deadline const deadline{Clock::now() + options_.timeout + master_grace_};
    int const rank = options_.rank;

    // 1. request: own allgather block, or the broadcast data when this rank is the root
    FrameHeader header = make_header(static_cast<uint32_t>(desc.op));
    header.seq = seq;
    header.op_bytes = desc.bytes;
    header.root = desc.root;
    bool const sends_data =
        desc.op == BootstrapOp::kAllgather || (desc.op == BootstrapOp::kBroadcast && rank == desc.root);
    header.payload_bytes = sends_data ? desc.bytes : 0;
    Outgoing request;
    request.start(header, send);

    // 2. reply, checked against this rank's call
    std::size_t expected = 0;
    if (desc.op == BootstrapOp::kAllgather) expected = options_.world * desc.bytes;
    if (desc.op == BootstrapOp::kBroadcast && rank != desc.root) expected = desc.bytes;
    Incoming in;
    std::string const what = concat("the result of ", describe(desc), " (operation #", seq, ")");
    exchange_with_master(request, in, deadline, what, [&](Incoming& frame) {
      FrameHeader const& reply = frame.header;
      if (reply.job != job_)
        fail(concat("rank 0 (master) answered ", describe(desc), " (operation #", seq, ") for another job (nonce ",
                    reply.job, ", this job's is ", job_, "); the stream is corrupt"));
      if (reply.magic != kMagic || !(frame_desc(reply) == desc) || reply.seq != seq || reply.payload_bytes != expected)
        fail(concat("rank 0 (master) answered ", describe(desc), " (operation #", seq, ") with a ",
                    frame_name(reply.kind), " frame (operation #", reply.seq, ", ", reply.payload_bytes,
                    " bytes, expected ", expected,
                    "); the stream is corrupt: check that every rank runs the same Ferry build"));
      frame.payload = static_cast<char*>(recv);
      frame.payload_len = expected;
    });
  }

  // Sends out to rank 0 and receives its answer into in. An abort frame from rank 0 (which may come before the
  // request is fully sent, when rank 0 already gave up) is turned into a BootstrapError carrying rank 0's reason;
  // on_header checks any other answer and sets where its payload goes.
  template <typename OnHeader>
  void exchange_with_master(Outgoing& out, Incoming& in, Deadline const& deadline, std::string const& what,
                            OnHeader&& on_header) {
    int const fd = master_.fd();
    std::string abort_text;
    auto const check = [&](Incoming& frame) {
      if (frame.header.magic == kMagic &&
          (frame.header.kind == kAbortFrame || frame.header.kind == kRefuseFrame || frame.header.kind == kStopFrame)) {
        if (frame.header.payload_bytes > kMaxAbortText)
          fail(concat("rank 0 (master) sent an abort frame of ", frame.header.payload_bytes,
                      " bytes; the stream is corrupt"));
        abort_text.resize(frame.header.payload_bytes);
        frame.payload = abort_text.data();
        frame.payload_len = abort_text.size();
        return;
      }
      if (out.active)
        fail(concat("rank 0 (master) answered before rank ", options_.rank,
                    " finished its request; the stream is corrupt: check that every rank runs the same Ferry build"));
      on_header(frame);
    };
    auto const master_closed = [&](std::string const& error) {
      master_.close();
      fail(concat("rank 0 (master) closed the connection (", error, ") while rank ", options_.rank, " waited for ",
                  what, "; rank 0 failed or died: see its output"));
    };
    while (!in.done) {
      std::string error;
      if (out.active && write_some(fd, out, error) == Io::kClosed) {
        // rank 0 may have said why before closing: read what is left
        out.active = false;
        if (read_frame(fd, in, error, check) != Io::kDone || abort_text.empty()) master_closed(error);
        break;
      }
      if (read_frame(fd, in, error, check) == Io::kClosed) master_closed(error);
      if (in.done) break;
      std::vector<pollfd> fds = {{fd, static_cast<short>(POLLIN | (out.active ? POLLOUT : 0)), 0}};
      if (poll_until(fds, deadline) == 0) {
        master_.close();
        fail(concat("rank 0 (master) at ", master_endpoint(), " did not send ", what, " within ",
                    describe_duration(options_.timeout + master_grace_),
                    "; rank 0 or another rank is stuck, much slower, or not calling the same bootstrap operations"
                    " (FERRY_BOOTSTRAP_TIMEOUT_S sets the limit)"));
      }
    }
    if (in.header.kind == kAbortFrame || in.header.kind == kStopFrame) {
      master_.close();
      std::string const stop = concat("rank 0 (master) stopped the job: ", abort_text);
      if (in.header.kind == kStopFrame) stop_text_ = stop;
      fail(stop);
    }
    if (in.header.kind == kRefuseFrame) {
      master_.close();
      fail(concat("rank ", options_.rank, " (WORLD_SIZE=", options_.world, ", ", run_id_text(options_.run_id),
                  ") could not join the job at ", master_endpoint(), ": ", abort_text));
    }
  }

  [[noreturn]] void fail(std::string const& message) {
    failure_ = message;
    master_.close();
    FERRY_THROW(BootstrapError, "bootstrap", message);
  }

  SocketBootstrapOptions const options_;
  std::chrono::milliseconds const master_grace_;
  uint64_t next_seq_ = 0;
  std::string failure_;  // first error; every later call throws it
  uint64_t job_ = 0;     // the job's nonce: drawn by rank 0, handed out in the welcome, carried by every frame
  // rank 0
  std::vector<Peer> peers_;  // by rank; [0] unused
  Socket rejected_;          // a connection whose hello was refused, kept to tell it why
  Socket listener_;          // MASTER_PORT, held while the job lives
  Clock::time_point listen_start_;
  Clock::time_point met_at_;     // the end of the rendezvous
  std::thread doorman_;          // answers newcomers after the rendezvous (doorman_loop)
  int stop_pipe_[2] = {-1, -1};  // the destructor stops the doorman
  int wake_pipe_[2] = {-1, -1};  // the doorman wakes a collective in progress
  mutable std::mutex clash_mutex_;
  std::string clash_;       // why the doorman stopped the job (stopped())
  std::mutex peers_mutex_;  // peers_ and rejected_ once the doorman runs: its abort, rank 0's collectives
  // ranks 1..world-1
  Socket master_;
  Clock::time_point next_alive_check_;
  std::string stop_text_;  // rank 0 stopped the job (a clash): every later check_alive throws it
};

void validate(SocketBootstrapOptions const& o) {
  auto const check = [](bool ok, auto const&... message) {
    if (!ok) FERRY_THROW(BootstrapError, "bootstrap", message...);
  };
  check(o.world >= 1, "world=", o.world, " must be at least 1; check WORLD_SIZE");
  check(o.rank >= 0 && o.rank < o.world, "rank=", o.rank, " is outside [0, world=", o.world,
        "); check RANK and WORLD_SIZE");
  check(o.local_world >= 1 && o.local_world <= o.world, "local_world=", o.local_world,
        " must be in [1, world=", o.world, "]; check LOCAL_WORLD_SIZE");
  check(o.local_rank >= 0 && o.local_rank < o.local_world, "local_rank=", o.local_rank,
        " is outside [0, local_world=", o.local_world, "); check LOCAL_RANK and LOCAL_WORLD_SIZE");
  check(o.world == 1 || (o.master_port >= 1 && o.master_port <= 65535), "master_port=", o.master_port,
        " is not a TCP port (1..65535); check MASTER_PORT");
  check(o.world == 1 || !o.master_addr.empty(), "master_addr is empty; set MASTER_ADDR to rank 0's host");
  check(o.timeout.count() > 0, "timeout=", o.timeout.count(),
        " ms must be positive (every bootstrap wait is bounded); check FERRY_BOOTSTRAP_TIMEOUT_S");
  // NOTE: the deadlines are the clock plus the timeout in 64-bit nanoseconds; kMaxTimeoutSeconds keeps far from the
  // wrap-around that would make every wait end at once.
  check(o.timeout.count() <= static_cast<int64_t>(kMaxTimeoutSeconds) * 1000, "timeout=", o.timeout.count(),
        " ms is more than the longest bound a wait takes, ", static_cast<int64_t>(kMaxTimeoutSeconds),
        " s (about 31 years); check FERRY_BOOTSTRAP_TIMEOUT_S");
}

// A whole number from an env text, or a BootstrapError naming the variable and what it should hold.
int64_t parse_env_int(char const* name, std::string const& text, char const* meaning) {
  if (text.empty())
    FERRY_THROW(BootstrapError, "bootstrap", name, " is not set; it must hold ", meaning,
                " (torchrun and `ferry` set it; set it yourself when starting ranks by hand)");
  errno = 0;
  char* end = nullptr;
  long long const value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0' || value < INT32_MIN || value > INT32_MAX)
    FERRY_THROW(BootstrapError, "bootstrap", name, "=", text, " is not a whole number; it must hold ", meaning);
  return value;
}

}  // namespace

std::unique_ptr<Bootstrap> make_socket_bootstrap(SocketBootstrapOptions const& options) {
  validate(options);
  return std::make_unique<SocketBootstrap>(options);
}

SocketBootstrapOptions socket_bootstrap_options_from_env() {
  SocketBootstrapOptions options;
  options.master_addr = env_string("MASTER_ADDR");
  options.master_port =
      static_cast<int>(parse_env_int("MASTER_PORT", env_string("MASTER_PORT"), "the TCP port rank 0 listens on"));
  options.rank = static_cast<int>(parse_env_int("RANK", env_string("RANK"), "this process's rank in [0, WORLD_SIZE)"));
  options.world = static_cast<int>(parse_env_int("WORLD_SIZE", env_string("WORLD_SIZE"), "the number of ranks"));
  options.local_rank =
      static_cast<int>(parse_env_int("LOCAL_RANK", env_string("LOCAL_RANK"), "this process's rank on its host"));
  // NOTE: LOCAL_WORLD_SIZE is optional (defaults to WORLD_SIZE: one host).
  std::string const local_world = env_string("LOCAL_WORLD_SIZE");
  options.local_world =
      local_world.empty()
          ? options.world
          : static_cast<int>(parse_env_int("LOCAL_WORLD_SIZE", local_world, "the number of ranks on this host"));
  int64_t const timeout_s = parse_env_int("FERRY_BOOTSTRAP_TIMEOUT_S", env_string("FERRY_BOOTSTRAP_TIMEOUT_S"),
                                          "the bootstrap deadline in seconds");
  if (timeout_s <= 0)
    FERRY_THROW(BootstrapError, "bootstrap", "FERRY_BOOTSTRAP_TIMEOUT_S=", timeout_s,
                " must be a positive number of seconds (every bootstrap wait is bounded)");
  options.timeout = std::chrono::seconds(timeout_s);
  options.run_id = env_string("TORCHELASTIC_RUN_ID");
  validate(options);
  return options;
}

}  // namespace ferry
