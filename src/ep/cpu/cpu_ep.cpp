// The cpu reference backend of EpBuffer: the normal-mode protocol of docs/design.md ("Modes") as host loops over the
// communicator's shared memory. Dispatch: count exchange (each rank publishes its row of the W x W count matrix in its
// own region and reads the others' rows from theirs), barrier, each sender computes its offsets in every destination
// and pushes rows and metadata straight into their final slots, barrier. Combine: each receiver reduces its rows into
// its own send-back area, barrier, each source pulls and sums its tokens' rows over the destinations in ascending
// order, barrier. The per-row arithmetic is ref::reduce_row / accumulate_row / round_row, so results are bit-identical
// with ref::.
//
// Across nodes (a topology of N nodes x M ranks, normal mode: docs/internode.md) the protocol is hierarchical, as the
// cuda one: a source's row for another node goes once to that node's rail (the rank with the source's local index),
// into the rail's forward area, and the rail places it in the final rows of its node's ranks (it computes the
// offsets from the count matrix, as a source does). Combine: a receiver leaves the bf16 row of a source on another
// node for the rail, which sums its node's rows of the token (ranks ascending, fp32), rounds, and leaves one wire row
// per (token, node) in its network area; the source sums nodes ascending (ref::, "Across nodes"). Every step between
// two barriers; the bytes each rank sends are counted by link (EpBuffer::link_bytes).
//
// Low-latency mode has the same semantics (docs/design.md, "Semantics") with its own output contract: every dispatch
// fills the expert-major layout, recv_x is not returned, and each leg splits into a send half (dispatch: steps 1-5, the
// rows have landed on every rank; combine: step 1, the rows to send back are published) and a receive half (dispatch:
// the expert-major layout; combine: the sum). With return_recv_hook the receive half waits for complete_dispatch /
// complete_combine; otherwise it follows at once.
//
// Rank masking and the wait statistics (EpConfig::rank_masking / wait_stats, low-latency mode) replace the
// communicator's barrier by this buffer's own (sync()), over the ranks not masked, with a time per source. With
// masking every sync is an agreement: each rank announces its arrival and waits for the others (bounded by
// FERRY_TIMEOUT_S); the ranks it saw are its view, its first estimate of the call's ranks. Then rounds of estimates
// (agree()): each rank writes its estimate into every rank, waits for those of the ranks it still hears from, and
// takes the intersection, less the ranks it no longer hears from; a rank that heard every one it waited for has
// decided, says so in its next round's word and goes on; a rank that reads a decision adopts it. A rank that dies part
// way through writing its words (seen by some ranks and not others) only delays the decision by a round: the estimates
// still meet, and every rank that stays computes the same set, however the writes were cut (docs/internode.md "Rank
// masking", "Who decides"). A rank's view holds every rank that arrived before its own deadline, so a late rank is left
// out by every rank and learns it from the same words when it comes. A call's entry exchange (join_call) goes on
// without the ranks it masked; a later sync of the call that masks one fails the call (its rows may be half written),
// and the final one of a combine goes on (every sum is done).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/comm_impl.hpp"
#include "core/interrupt.hpp"
#include "core/log.hpp"
#include "core/rank_set.hpp"
#include "ep/capacity.hpp"
#include "ep/ep_impl.hpp"
#include "ep/ll_mask_words.hpp"
#include "ep/reference.hpp"
#include "ferry/error.hpp"
#include "wire/codec.hpp"

namespace ferry::detail {
namespace {

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

// Private, lazily backed memory for the expert-major layout: only the pages of filled slots are ever touched.
class LocalPages {
 public:
  LocalPages() = default;
  explicit LocalPages(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ == 0) return;
    void* const base =
        mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    FERRY_CHECK_CONFIG(base != MAP_FAILED, "the expert-major layout needs ", bytes_, " bytes (num_local_experts x ",
                       "expert_capacity x hidden x 2) and mmap failed: ", std::strerror(errno),
                       "; lower expert_capacity");
    base_ = static_cast<char*>(base);
  }
  ~LocalPages() {
    if (base_ && munmap(base_, bytes_) != 0)
      FERRY_LOG_WARN("cpu ep: munmap of the expert-major layout failed: ", std::strerror(errno));
  }
  LocalPages(LocalPages&& other) noexcept : base_(std::exchange(other.base_, nullptr)), bytes_(other.bytes_) {}
  LocalPages& operator=(LocalPages&& other) noexcept {
    std::swap(base_, other.base_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  char* data() const { return base_; }

 private:
  char* base_ = nullptr;
  std::size_t bytes_ = 0;
};

// The call header each rank publishes at the first barrier of every call (DESIGN "Collective consistency"): which
// call of this buffer it is in, and whether it refused it on input. Every rank reads every header after that
// barrier, so all of them take the same decision: go on, fail the call (a refusal), or fail the buffer (out of step).
enum class CallKind : uint32_t { dispatch = 0, combine = 1, grad_weights = 2 };

struct CallHeader {
  uint64_t step;     // collective calls of this buffer so far, this one included; its parity picks the slot
  uint32_t kind;     // CallKind
  uint32_t refused;  // 1: this rank refused the call on input (its reason below)
  uint64_t number;   // calls of this kind on this buffer so far, this one included
  // the refusing rank's reason (parity-buffered with the header: the communicator's slot may already hold the reason
  // of its next refusal by the time a slow peer reads)
  char reason[kRefusalBytes];
  // followed by RankSet::words_for(world) words: with rank masking, the ranks this rank asks to mask
  // (EpBuffer::mask_ranks), bit r for rank r (CpuEp::header_bytes_)
};
static_assert(sizeof(CallHeader) % sizeof(uint64_t) == 0, "the words of the proposed ranks follow the header");
static_assert(offsetof(CallHeader, reason) % sizeof(uint64_t) == 0 && kRefusalBytes % sizeof(uint64_t) == 0,
              "the reason is stored in 64-bit words");

// A peer's call header as one rank read it (CpuEp::read_header).
struct HeaderCopy {
  uint64_t step = 0;  // kRewritten: its writer was rewriting the slot (it went past the reader's call)
  uint32_t kind = 0;
  uint32_t refused = 0;
  uint64_t number = 0;
  RankSet proposed;
  std::string reason;  // when refused
};

// The parity slots (call headers, verdicts) are sequence locks. A rank reads a peer's slot after a sync, and with
// rank masking a peer does not wait at the next sync for a rank left out of it: it may come back to the same slot
// two calls later while a slow rank still reads it. So every word of a slot is an atomic; the writer first sets the
// slot's tag word to a mark, then writes the words and publishes the tag (release); the reader loads the tag
// (acquire), the words, and the tag again. A tag that changed, or the mark, says the slot was being rewritten: the
// writer went past the reader's call without it. The words are stored with release and loaded with acquire, so a
// word of a rewrite that the reader saw makes the mark visible to its second load of the tag (no fences, which
// ThreadSanitizer does not model).
constexpr uint64_t kRewritten = UINT64_MAX;  // a header's mark (a verdict's is 0: its readers wait for the epoch)

void open_slot(uint64_t* tag, uint64_t mark) {
  std::atomic_ref<uint64_t>(*tag).store(mark, std::memory_order_relaxed);
}
void publish_slot(uint64_t* tag, uint64_t value) {
  std::atomic_ref<uint64_t>(*tag).store(value, std::memory_order_release);
}
// the tag as seen before the words are read
uint64_t slot_tag(uint64_t const* tag) {
  return std::atomic_ref<uint64_t const>(*tag).load(std::memory_order_acquire);
}
// after the words are read: whether the tag still holds `seen`
bool slot_unchanged(uint64_t const* tag, uint64_t seen) {
  return std::atomic_ref<uint64_t const>(*tag).load(std::memory_order_relaxed) == seen;
}
template <typename T>
void store_word(T* at, T value) {
  std::atomic_ref<T>(*at).store(value, std::memory_order_release);
}
template <typename T>
T load_word(T const* at) {
  return std::atomic_ref<T const>(*at).load(std::memory_order_acquire);
}
// count words of a slot, from a private copy / into one
void store_words(uint64_t* to, uint64_t const* from, std::size_t count) {
  for (std::size_t w = 0; w < count; ++w) store_word(to + w, from[w]);
}
void load_words(uint64_t* to, uint64_t const* from, std::size_t count) {
  for (std::size_t w = 0; w < count; ++w) to[w] = load_word(from + w);
}
// a RankSet of num_words words (RankSet::words_for(world), at most RankSet::kWords)
void store_set(uint64_t* words, RankSet const& set, int num_words) {
  uint64_t bits[RankSet::kWords] = {};
  set.store(bits, num_words);
  store_words(words, bits, static_cast<std::size_t>(num_words));
}
RankSet load_set(uint64_t const* words, int num_words) {
  uint64_t bits[RankSet::kWords] = {};
  load_words(bits, words, static_cast<std::size_t>(num_words));
  return RankSet::load(bits, num_words);
}
constexpr std::size_t kReasonWords = kRefusalBytes / sizeof(uint64_t);  // CallHeader::reason in 64-bit words

// What a handle keeps on the cpu backend: this rank's view of the dispatch (host memory).
struct CpuHandle final : HandleStorage {
  std::vector<int32_t> fwd_rows;  // across nodes: the rail's forwarded entries' rows (CpuEp::fwd_rows_)
  std::vector<int64_t> fwd_num;
  std::vector<int64_t> ids;  // [num_tokens * topk]
  std::vector<float> weights;
  std::vector<RankSet> dest_mask;
  std::vector<int64_t> dest_offset;
  int32_t num_recv = 0;
  std::vector<int32_t> recv_idx;  // [num_recv * topk]
  std::vector<float> recv_weights;
  std::vector<int32_t> recv_src;  // [num_recv * 2]
  std::vector<int32_t> recv_slot;
  std::vector<int32_t> expert_counts;
  std::vector<int32_t> rank_counts;  // [world * world] rows rank s sent to rank d (EpBuffer::copy_rank_counts)
};

char const* call_kind_name(uint32_t kind) {
  return kind == static_cast<uint32_t>(CallKind::dispatch) ? "dispatch" : "combine";
}

// Where a sync (CpuEp::sync) sits in a call, which decides what a rank masked there does to the call: the entry
// exchange goes on without it, a sync inside the call fails the call (the rank's rows may be half written), the last
// sync of a combine goes on (every sum is done; the rank may still be reading, but nothing it reads is reused while it
// is masked).
enum class SyncPoint { entry, inner, exit };
// The leg whose wait per source a sync times for the wait statistics: the entry exchange of each leg, where a late
// source is waited for (after it every source's rows are, or are being, written, with no wait of its own to speak of).
enum class StatsLeg { none = -1, dispatch = 0, combine = 1 };

class CpuEp final : public EpBackendImpl {
 public:
  CpuEp(Communicator& comm, EpConfig const& config);
  ~CpuEp() override;
  CpuEp(CpuEp const&) = delete;
  CpuEp& operator=(CpuEp const&) = delete;

  DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream) override;
  void combine(CombineArgs const& args, cudaStream_t stream) override;
  std::string explain() const override;
  CallLinkBytes link_bytes(cudaStream_t stream) const override;
  DispatchResult complete_dispatch(cudaStream_t stream) override;
  void complete_combine(cudaStream_t stream) override;
  void refuse_dispatch(cudaStream_t stream) override;
  void refuse_combine(cudaStream_t stream) override;

  std::unique_ptr<HandleStorage> make_handle_storage(void* external) const override;
  void save_handle(HandleState& handle, DispatchArgs const& args, cudaStream_t stream) override;
  DispatchArgs cached_args(HandleState const& handle, DispatchArgs args) const override;
  void restore_handle(HandleState const& handle, cudaStream_t stream) override;
  void copy_rank_counts(HandleState const& handle, int32_t* out, cudaStream_t stream) const override;
  void combine_unweighted(CombineArgs const& args, bool y_fp32, cudaStream_t stream) override;
  void combine_backward_weights(HandleState const& handle, void const* x, float* grad_w, bool eager,
                                cudaStream_t stream) override;
  void refuse_combine_backward_weights(cudaStream_t stream) override;
  MaskStatus mask_status() const override;
  void mask_ranks(std::vector<int> const& ranks) override;
  void clear_mask() override;
  WaitStats wait_stats(cudaStream_t stream) const override;
  void reset_wait_stats(cudaStream_t stream) override;

 private:
  // combine, and dispatch_backward's (unit_weights: every expert-major weight 1; y_fp32: y is the fp32 sum)
  void run_combine(CombineArgs const& args, bool unit_weights, bool y_fp32);
  // combine_backward's weight step; refused: this rank joins the exchange with no dots of its own
  void exchange_grad_weights(void const* x, float* grad_w, bool refused, bool eager);
  // Publishes this rank's header, waits at the barrier, reads every rank's. A peer's refusal throws InputError naming
  // it (the lowest refusing peer) unless this rank refused the call too (it then throws its own error). Throws Error,
  // and marks the buffer out of step for good, when a rank is in another call.
  void join_call(CallKind kind, bool refused, StatsLeg leg = StatsLeg::none);
  // Rank r's header in the parity slot at `slot` (a sequence lock: HeaderCopy::step is kRewritten when r was
  // rewriting it), its reason copied when it refused.
  HeaderCopy read_header(int r, std::size_t slot) const;
  // The barrier of the low-latency protocol: the communicator's, or with masking or wait statistics this buffer's own
  // over the ranks not masked (see the top of the file). Throws what the masking rules say (Error: this rank is
  // masked; TimeoutError: a rank was lost inside the call), or, without masking, TimeoutError marking the
  // communicator failed as its barrier does.
  void sync(SyncPoint point, StatsLeg leg);
  // Waits until word p of `words` reaches `least` for every rank p in `want`, bounded by FERRY_TIMEOUT_S; returns
  // the ranks seen. With `leg`, each seen rank's wait goes to the statistics.
  // Word p is words[p * stride].
  RankSet wait_words(uint64_t const* words, std::size_t stride, RankSet const& want, uint64_t least, StatsLeg leg);
  // The rounds of estimates that follow a masking sync's arrivals (see the top of the file): the ranks of the call,
  // the same on every rank that stays. `present`: the ranks whose arrival this rank saw. Throws Error when this rank
  // learns it is masked, and fails the communicator when more ranks died inside this one agreement than its rounds
  // take (kMaskEstimateRounds).
  RankSet agree(uint64_t epoch, RankSet const& present, std::chrono::steady_clock::time_point start, WaitPhase phase);
  // The estimate word of `round` (2.. kMaskEstimateRounds + 2) of the sync `epoch` that rank `from` writes into rank
  // `to`
  uint64_t* estimate_slot(int to, int from, int round, uint64_t epoch) const {
    std::size_t const slot = at(round - 2, 2) + (epoch & 1);
    return reinterpret_cast<uint64_t*>(sync_.of(to)) + world_ + at(slot, world_) * verdict_words_ +
           at(from, verdict_words_);
  }
  [[noreturn]] void mask_self_ahead(int by, uint64_t epoch_seen);
  // A timeout that fails the communicator (no masking): recorded in the error block, raised by check_errors.
  [[noreturn]] void fail_communicator(WaitPhase phase, RankSet const& missing, uint64_t expected);
  void check_not_masked() const {
    if (!self_masked_.empty()) throw Error(self_masked_);
  }
  bool active(int r) const { return active_.test(r); }
  // Row s of this dispatch's count matrix, in rank s's own region (after the count exchange's barrier).
  int64_t const* count_row(int s) const { return reinterpret_cast<int64_t const*>(counts_.of(s)); }
  // Step 4b of a dispatch: keeps the count matrix for the handle it saves (for_handle), and counts every rank's rows
  // past its capacity where the capacity can drop rows.
  void read_count_matrix(bool for_handle);
  // Step 3b of a dispatch with rank masking: the masked ranks get nothing, and their entries are counted.
  void mask_dispatch(std::vector<int64_t> const& ids, int num_tokens);
  // The rank of node n that relays `source`'s rows there (forward route): the one of the source's local index, or,
  // when that one is masked (in `live`), the next live local index, ascending and wrapping; -1 when node n has none.
  int rail_of(int n, int source, RankSet const& live) const {
    for (int i = 0; i < topology_.local; ++i) {
      int const r = n * topology_.local + (topology_.local_of(source) + i) % topology_.local;
      if (live.test(r)) return r;
    }
    return -1;
  }
  // The source's entries in a rail's forward area: one block per source node, or with masking per source rank (a
  // rail may then relay several sources of one node)
  std::size_t fwd_slot(int source) const {
    return static_cast<std::size_t>(masking_ ? source : topology_.node_of(source));
  }
  // The sources whose rows this rank relays (forward route), ascending, as `live` chooses the rails
  std::vector<int> relayed_sources(RankSet const& live) const;
  void release_regions() noexcept;
  // across nodes: the rail places the rows forwarded to it (dispatch) and reduces its node's rows of them (combine)
  void forward_rows();
  void reduce_forwarded(WireFormat format);
  bool on_my_node(int peer) const { return topology_.same_node(peer, rank_); }
  // what explain() says of the hierarchy ("" on one node)
  std::string hierarchy() const {
    if (topology_.nodes == 1) return std::string();
    return hierarchical_ ? concat("hierarchical ", topology_name(topology_),
                                  ": rows for another node once per node through its rail, ")
                         : concat("direct ", topology_name(topology_), ": one put per (token, remote rank), ");
  }
  // node n's ranks
  RankSet node_ranks(int n) const { return RankSet::range(n * topology_.local, topology_.local); }
  // the proposed ranks that follow a CallHeader
  uint64_t* proposed_words(CallHeader* header) const { return reinterpret_cast<uint64_t*>(header + 1); }
  uint64_t const* proposed_words(CallHeader const* header) const {
    return reinterpret_cast<uint64_t const*>(header + 1);
  }
  // Rows the current dispatch did not deliver, over every rank (the same on every rank): rank-major rows past a
  // receive capacity, found by every rank in the count matrix; entries past expert_capacity, which only their
  // receiver finds, agreed on in one more barrier where the config can drop them (agree_slot_drops). Recorded in
  // every rank's error block and raised now when the call is eager.
  void report_drops(int64_t dropped, int first_rank, bool eager);
  // Every active rank's entries past expert_capacity in this call (mine: this rank's), and the first rank with any.
  int64_t agree_slot_drops(int64_t mine, int& first_rank);
  DispatchResult receive_dispatch();  // the receive half: expert-major layout, results, drop report
  void receive_combine();             // the receive half: sum into y

  Communicator& comm_;
  EpConfig config_;
  int rank_;
  int world_;
  int hidden_;
  int topk_;
  int num_local_;
  int capacity_;
  int slots_;
  std::size_t row_bytes_;        // a bf16 row
  WireRowLayout dispatch_wire_;  // a dispatch wire row (bf16: the row itself)
  WireRowLayout combine_wire_;   // a combine wire row
  std::size_t out_row_bytes_;    // a delivered row: bf16, or the quantized payload
  Topology topology_;
  bool hierarchical_;  // normal mode over several nodes
  int max_tokens_;
  std::size_t fwd_meta_bytes_;  // a forwarded entry's metadata: topk global ids (int32), topk weights, the token
  std::size_t combine_stride_;  // a row of combine_rows_: its wire row, or (across nodes) the bf16 row for the rail

  // symmetric memory (every rank's copy reachable from here)
  SymmetricRegion counts_;    // [world] int64 on rank s: entry d = rows rank s sends to rank d (its row of the matrix)
  SymmetricRegion recv_x_;    // [capacity x dispatch wire row], rank-major landing zone (bf16: recv_x itself)
  SymmetricRegion recv_idx_;  // [capacity x topk] int32 local expert or -1
  SymmetricRegion recv_weights_;  // [capacity x topk] float
  SymmetricRegion recv_src_;      // [capacity x 2] int32 (source rank, source token)
  SymmetricRegion combine_rows_;  // [capacity x combine wire row], the rows this rank sends back in combine
  SymmetricRegion slot_drops_;    // [world] int64: entry r = rank r's entries past expert_capacity in the current
                                  // dispatch (only where the config can drop slots: slots_can_drop_)
  SymmetricRegion headers_;       // [2 parities] CallHeader and its proposed ranks, header_bytes_ each, of this rank
                                  // (peers read it from their mapping)
  SymmetricRegion grad_w_;        // [max_tokens x topk] float: combine_backward's weight gradients of this rank's
                                  // tokens, written by the ranks that hold the experts
  // across nodes: this rank as a rail, for the source of local index local(rank) on each node m
  SymmetricRegion fwd_x_;          // [nodes x max_tokens x dispatch wire row] rows forwarded to this rank
  SymmetricRegion fwd_meta_;       // [nodes x max_tokens x fwd_meta_bytes_]
  SymmetricRegion fwd_count_;      // [nodes] int64 entries forwarded from node m
  SymmetricRegion net_rows_;       // [nodes x max_tokens x combine wire row] one reduced row per forwarded entry
  std::vector<int32_t> fwd_rows_;  // [nodes x max_tokens x local] row of entry (m, j) on local rank l, -1: none
  std::vector<int64_t> fwd_num_;   // [nodes] entries forwarded from node m in the last dispatch
  CallLinkBytes link_bytes_;
  std::vector<HeaderCopy> seen_headers_;  // [world] the headers join_call read, of the ranks in the call
  uint64_t step_ = 0;
  uint64_t calls_[3] = {};   // by CallKind
  std::string out_of_step_;  // set once a rank was found in another call: every later call throws it

  // rank masking and wait statistics (EpConfig::rank_masking / wait_stats)
  bool masking_;
  bool stats_on_;
  bool own_sync_;             // sync() runs this buffer's barrier (masking or statistics), not the communicator's
  int fwd_slots_;             // blocks of the forward areas (fwd_slot)
  int set_words_;             // RankSet::words_for(world): a set of ranks in shared memory
  std::size_t header_bytes_;  // a CallHeader and its proposed ranks
  // per rank: [world] arrival epochs (word p written by rank p), then [kMaskEstimateSlots rounds][2 parities][world]
  // estimates of verdict_words_ each (a tag: the epoch << 1 | decided; then the ranks its writer holds for the call)
  SymmetricRegion sync_;
  std::size_t verdict_words_;
  uint64_t epoch_ = 0;             // syncs of this buffer so far
  RankSet all_ranks_;              // every rank of the world
  RankSet active_;                 // the ranks not masked
  RankSet dispatch_active_;        // ...when the last dispatch moved its rows (its rails and destinations)
  RankSet proposed_;               // mask_ranks, carried by the next entry exchange
  std::string self_masked_;        // set when this rank learned that it is masked: every call throws it
  RankSet self_view_;              // then: the ranks it learned are masked (itself included)
  uint32_t current_kind_ = 0;      // the call being synced (CallKind; step_ is its step), for the messages:
  uint64_t current_number_ = 0;    // call_text() names it ("dispatch #3 (call 5 of the buffer)") when one is made
  std::vector<int64_t> last_ids_;  // masking: the last dispatch's ids (combine counts what it misses)
  MaskStatus counts_of_masking_;
  std::vector<PeerWaitStats> waits_[2];  // [leg][source]

  // this rank's view of the last dispatch
  int num_tokens_ = 0;
  int32_t num_recv_ = 0;
  std::vector<RankSet> dest_mask_;    // [num_tokens] the ranks the token went to
  std::vector<int64_t> dest_offset_;  // [world] first row of this rank's tokens on rank d
  std::vector<int32_t> rank_counts_;  // [world * world] the count matrix, copied before a peer can overwrite it
  ref::ExpertLayout layout_;
  LocalPages expert_x_;  // [num_local x slots x out_row_bytes_], only with an expert capacity
  // quantized formats: what is delivered (payload + scales, or dequantized bf16 rows), in local memory
  std::vector<uint8_t> recv_out_;           // [capacity x out_row_bytes_] (not for bf16, which is recv_x_)
  std::vector<uint8_t> recv_scales_;        // scale tensor of capacity rows (delivers_quantized)
  std::vector<float> recv_token_scales_;    // [capacity] (nvfp4)
  std::vector<uint8_t> expert_scales_;      // num_local scale tensors of slots rows
  std::vector<float> expert_token_scales_;  // [num_local x slots] (nvfp4)
  std::vector<uint8_t> wire_scratch_;       // one wire row
  std::vector<uint8_t> gather_scratch_;     // one expert's wire rows
  std::vector<uint16_t> row_scratch_;       // one bf16 row
  std::vector<float> scratch_;
  bool low_latency_ = false;
  // An expert's entries can outnumber its slots (expert_capacity below the receive capacity): every dispatch then
  // agrees on the slots it dropped (agree_slot_drops). The same on every rank (the configs are compared).
  bool slots_can_drop_ = false;
  // what the receive half of the current call needs from its send half
  bool pending_expand_ = false;
  bool pending_eager_ = true;
  int64_t pending_row_drops_ = 0;  // rows past a receive capacity, over every rank (from the count matrix)
  int pending_drop_rank_ = -1;     // the first rank whose receive capacity was exceeded
  void* pending_y_ = nullptr;
  bool pending_y_fp32_ = false;
  int32_t* counts_host_ = nullptr;                // DispatchArgs::expert_counts_host of the last dispatch
  int pending_group_ = 1;                         // CombineArgs::group
  float const* pending_group_weights_ = nullptr;  // CombineArgs::group_weights (null: group 1, unweighted)
  // What the last dispatch and combine ran, for explain(), which builds its text when asked (nothing is formatted
  // on a call's path).
  enum class DispatchRan : uint8_t { none, dispatch, combine_backward };
  struct LastDispatch {
    DispatchRan ran = DispatchRan::none;
    bool expand = false;
    bool hook = false;
  } last_dispatch_;
  struct LastCombine {
    bool ran = false;
    bool unit_weights = false;  // dispatch_backward's combine of gradients
    bool expert_major = false;
    bool hook = false;
  } last_combine_;
  std::string call_text() const {
    return concat(call_kind_name(current_kind_), " #", current_number_, " (call ", step_, " of the buffer)");
  }
};

namespace {
// Copies src into dst, whose size was fixed at construction to the largest src can be; the rest of dst is zeroed.
void keep_storage_copy(std::vector<int32_t> const& src, std::vector<int32_t>& dst) {
  FERRY_CHECK(src.size() <= dst.size(), "cpu backend: layout of ", src.size(), " entries exceeds its storage of ",
              dst.size());
  std::copy(src.begin(), src.end(), dst.begin());
  std::fill(dst.begin() + static_cast<std::ptrdiff_t>(src.size()), dst.end(), 0);
}
}  // namespace

CpuEp::CpuEp(Communicator& comm, EpConfig const& config)
    : comm_(comm),
      config_(config),
      rank_(comm.rank()),
      world_(comm.world()),
      hidden_(config.hidden),
      topk_(config.topk),
      num_local_(config.num_local_experts(comm.world())),
      capacity_(config.recv_capacity(comm.world())),
      slots_(config.expert_slots()),
      row_bytes_(at(config.hidden, sizeof(uint16_t))),
      dispatch_wire_(wire_row_layout(config.dispatch_format, config.hidden)),
      combine_wire_(wire_row_layout(config.combine_format, config.hidden)),
      out_row_bytes_(config.recv_row_bytes()),
      topology_(comm.topology()),
      hierarchical_(comm.topology().nodes > 1 && config.route() == InternodeRoute::forward),
      max_tokens_(config.max_tokens_per_rank),
      fwd_meta_bytes_(at(config.topk, 8) + 8),
      combine_stride_(comm.topology().nodes > 1 ? std::max(combine_wire_.row_bytes, row_bytes_)
                                                : combine_wire_.row_bytes),
      low_latency_(config.mode == Mode::low_latency) {
  masking_ = config.rank_masking;
  stats_on_ = config.wait_stats;
  own_sync_ = masking_ || stats_on_;
  fwd_slots_ = masking_ ? world_ : topology_.nodes;
  set_words_ = RankSet::words_for(world_);
  header_bytes_ = sizeof(CallHeader) + at(set_words_, sizeof(uint64_t));
  verdict_words_ = 1 + static_cast<std::size_t>(set_words_);
  all_ranks_ = RankSet::range(0, world_);
  active_ = all_ranks_;
  dispatch_active_ = all_ranks_;
  for (auto& leg : waits_) leg.assign(static_cast<std::size_t>(world_), PeerWaitStats{});
  // Collective: every rank allocates the same regions in the same order.
  try {
    // One row per rank, read in place by the others: the matrix is W x W over the world, not on every rank (which
    // would be W^3 bytes in one host's shared memory at a wide world).
    counts_ = comm_.alloc_symmetric(at(world_, sizeof(int64_t)));
    recv_x_ = comm_.alloc_symmetric(at(capacity_, 1) * dispatch_wire_.row_bytes);
    recv_idx_ = comm_.alloc_symmetric(at(capacity_, topk_) * sizeof(int32_t));
    recv_weights_ = comm_.alloc_symmetric(at(capacity_, topk_) * sizeof(float));
    recv_src_ = comm_.alloc_symmetric(at(capacity_, 2) * sizeof(int32_t));
    combine_rows_ = comm_.alloc_symmetric(at(capacity_, 1) * combine_stride_);
    slots_can_drop_ = slots_ > 0 && slots_ < capacity_;
    if (slots_can_drop_) slot_drops_ = comm_.alloc_symmetric(at(world_, sizeof(int64_t)));
    headers_ = comm_.alloc_symmetric(2 * header_bytes_);  // zeroed: step 0 is "no call yet"
    if (!low_latency_) grad_w_ = comm_.alloc_symmetric(at(config.max_tokens_per_rank, topk_) * sizeof(float));
    if (hierarchical_) {
      std::size_t const entries = at(fwd_slots_, max_tokens_);
      fwd_x_ = comm_.alloc_symmetric(entries * dispatch_wire_.row_bytes);
      fwd_meta_ = comm_.alloc_symmetric(entries * fwd_meta_bytes_);
      fwd_count_ = comm_.alloc_symmetric(at(fwd_slots_, sizeof(int64_t)));
      net_rows_ = comm_.alloc_symmetric(entries * combine_wire_.row_bytes);
    }
    if (own_sync_)  // zeroed: epoch 0
      sync_ = comm_.alloc_symmetric((at(world_, 1) + at(2 * kMaskEstimateSlots, world_) * verdict_words_) *
                                    sizeof(uint64_t));
  } catch (...) {
    release_regions();  // the destructor does not run for a constructor that throws
    throw;
  }
  if (slots_ > 0) expert_x_ = LocalPages(at(static_cast<int64_t>(num_local_) * slots_, 1) * out_row_bytes_);
  WireFormat const format = config.dispatch_format;
  if (format != WireFormat::bf16 && !low_latency_) recv_out_.resize(at(capacity_, 1) * out_row_bytes_);
  if (config.delivers_quantized()) {
    if (!low_latency_) {
      recv_scales_.resize(scale_tensor_bytes(format, config.recv_scale_layout, capacity_, hidden_));
      if (dispatch_wire_.has_token_scale) recv_token_scales_.resize(static_cast<std::size_t>(capacity_));
    }
    if (slots_ > 0) {
      expert_scales_.resize(at(num_local_, 1) * scale_tensor_bytes(format, config.recv_scale_layout, slots_, hidden_));
      if (dispatch_wire_.has_token_scale) expert_token_scales_.resize(at(num_local_, slots_));
      gather_scratch_.resize(at(slots_, 1) * dispatch_wire_.row_bytes);
    }
  }
  wire_scratch_.resize(std::max(dispatch_wire_.row_bytes, combine_wire_.row_bytes));
  row_scratch_.resize(static_cast<std::size_t>(hidden_));
  // the expert layout's storage, sized once for the largest call (see receive_dispatch)
  layout_.expert_counts.assign(static_cast<std::size_t>(num_local_), 0);
  layout_.recv_slot.assign(at(capacity_, topk_), 0);
  layout_.expert_src_row.assign(at(static_cast<int64_t>(num_local_) * slots_, 1), 0);
  scratch_.resize(static_cast<std::size_t>(hidden_));
  dest_offset_.assign(static_cast<std::size_t>(world_), 0);
  seen_headers_.resize(static_cast<std::size_t>(world_));
  if (hierarchical_) {
    fwd_rows_.assign(at(static_cast<int64_t>(fwd_slots_) * max_tokens_, topology_.local), -1);
    fwd_num_.assign(static_cast<std::size_t>(fwd_slots_), 0);
  }
  counts_of_masking_.enabled = masking_;
}

CpuEp::~CpuEp() {
  release_regions();
}

void CpuEp::release_regions() noexcept {
  for (SymmetricRegion* region :
       {&counts_, &recv_x_, &recv_idx_, &recv_weights_, &recv_src_, &combine_rows_, &slot_drops_, &headers_, &grad_w_,
        &fwd_x_, &fwd_meta_, &fwd_count_, &net_rows_, &sync_})
    if (region->local != nullptr) comm_.release_symmetric(*region);
}

void CpuEp::join_call(CallKind kind, bool refused, StatsLeg leg) {
  if (!out_of_step_.empty()) throw Error(out_of_step_);
  check_not_masked();
  uint64_t const step = ++step_;
  uint64_t const number = ++calls_[static_cast<int>(kind)];
  current_kind_ = static_cast<uint32_t>(kind);
  current_number_ = number;
  // NOTE: two slots by parity: a rank that is one call ahead writes the other slot while a slower one still reads
  // this one; it gets two calls ahead only by leaving this rank out of the next call (rank masking), which
  // read_header tells (the slots are sequence locks).
  std::size_t const slot = (step & 1) * header_bytes_;
  auto* const mine = reinterpret_cast<CallHeader*>(static_cast<char*>(headers_.local) + slot);
  open_slot(&mine->step, kRewritten);
  store_word(&mine->kind, static_cast<uint32_t>(kind));
  store_word(&mine->refused, refused ? 1u : 0u);
  store_word(&mine->number, number);
  store_set(proposed_words(mine), proposed_, set_words_);
  if (refused) {
    uint64_t reason[kReasonWords] = {};
    std::string const posted = comm_.refusal_of(rank_);  // posted by EpBuffer just before
    std::memcpy(reason, posted.data(), std::min(posted.size(), sizeof(reason) - 1));
    store_words(reinterpret_cast<uint64_t*>(mine->reason), reason, kReasonWords);
  }
  publish_slot(&mine->step, step);
  sync(SyncPoint::entry, leg);  // release / acquire: every header written before it is visible after it
  int refusing = -1;
  RankSet asked;  // rank masking: the union of the requests of the ranks in the call
  for (int r = 0; r < world_; ++r) {
    if (!active(r)) continue;  // masked: its header is not read (it may be in any call)
    HeaderCopy const& theirs = seen_headers_[static_cast<std::size_t>(r)] = read_header(r, slot);
    asked |= theirs.proposed;
    if (masking_ && theirs.step > step) {
      // NOTE: with masking a rank gets past this call only by going on without this rank (the parity slots hold
      // a rank one call ahead at most otherwise): it masked this rank, whose request or absence it saw first
      self_view_ = all_ranks_ - active_;
      self_view_.set(rank_);
      self_masked_ = format_error(
          "ferry", __FILE__, __LINE__,
          concat("rank ", rank_, " is masked on this EpBuffer: at ", call_text(), " rank ", r, " was already ",
                 theirs.step == kRewritten ? std::string("in a later call") : concat("in call ", theirs.step),
                 " of the buffer, past this call without this rank; its calls are refused "
                 "until every rank calls clear_mask()"));
      throw Error(self_masked_);
    }
    if (theirs.step != step || theirs.kind != mine->kind) {
      std::string const where = theirs.step == 0 ? std::string("had made no call on it yet")
                                                 : concat("was in ", call_kind_name(theirs.kind), " #", theirs.number,
                                                          " (call ", theirs.step, " of the buffer)");
      // NOTE: the barrier passed, so every rank is past the same number of barriers: the communicator stays in step
      out_of_step_ = format_error(
          "ferry", __FILE__, __LINE__,
          concat("calls out of step on this EpBuffer: rank ", rank_, " is in ", call_kind_name(mine->kind), " #",
                 number, " (call ", step, " of the buffer) but rank ", r, " ", where,
                 " at the same barrier; every rank must make the same dispatch / combine calls in the same order. "
                 "No data of this call is returned, and this EpBuffer refuses every later call: destroy it on every "
                 "rank and create a new one (the communicator stays usable)"));
      throw Error(out_of_step_);
    }
  }
  proposed_ = RankSet();
  if (masking_ && asked.intersects(active_)) {
    // every rank of the call read the same headers: the same ranks leave, here, before any row moves
    RankSet const leaving = asked & active_;
    if (leaving.test(rank_)) {
      self_view_ = (all_ranks_ - active_) | leaving;
      self_masked_ = format_error("ferry", __FILE__, __LINE__,
                                  concat("rank ", rank_, " is masked on this EpBuffer: at ", call_text(),
                                         " mask_ranks asked for rank(s) ", leaving.text(),
                                         ", and the other ranks go on without it; its calls are refused until every "
                                         "rank calls clear_mask()"));
      throw Error(self_masked_);
    }
    active_ -= leaving;
    FERRY_LOG_WARN("rank ", rank_, ": rank(s) ", leaving.text(), " masked at ", call_text(),
                   " (mask_ranks); later calls skip them");
  }
  for (int r = 0; r < world_ && refusing < 0; ++r)  // (the active ranks' headers were read above)
    if (active(r) && r != rank_ && seen_headers_[static_cast<std::size_t>(r)].refused != 0) refusing = r;
  if (refusing >= 0 && !refused)
    FERRY_THROW(InputError, "input",
                describe_refusal(refusing, WaitPhase::none, seen_headers_[static_cast<std::size_t>(refusing)].reason));
}

HeaderCopy CpuEp::read_header(int r, std::size_t slot) const {
  auto const* const theirs = reinterpret_cast<CallHeader const*>(headers_.of(r) + slot);
  HeaderCopy copy;
  uint64_t const step = slot_tag(&theirs->step);
  copy.kind = load_word(&theirs->kind);
  copy.refused = load_word(&theirs->refused);
  copy.number = load_word(&theirs->number);
  copy.proposed = load_set(proposed_words(theirs), set_words_);
  if (copy.refused != 0) {
    uint64_t reason[kReasonWords];
    load_words(reason, reinterpret_cast<uint64_t const*>(theirs->reason), kReasonWords);
    auto const* const text = reinterpret_cast<char const*>(reason);
    copy.reason.assign(text, strnlen(text, sizeof(reason)));
  }
  copy.step = slot_unchanged(&theirs->step, step) ? step : kRewritten;
  return copy;
}

RankSet CpuEp::wait_words(uint64_t const* words, std::size_t stride, RankSet const& want, uint64_t least,
                          StatsLeg leg) {
  RankSet seen;
  auto const start = std::chrono::steady_clock::now();
  auto const deadline = start + std::chrono::nanoseconds(comm_.device_view().timeout_ns);
  for (uint64_t spin = 0;; ++spin) {
    for (int const p : want - seen) {
      if (std::atomic_ref<uint64_t const>(words[at(p, stride)]).load(std::memory_order_acquire) < least) continue;
      seen.set(p);
      if (leg == StatsLeg::none) continue;
      auto const ns = static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
      PeerWaitStats& stats = waits_[static_cast<int>(leg)][static_cast<std::size_t>(p)];
      stats.waits += 1;
      stats.total_ns += ns;
      stats.max_ns = std::max(stats.max_ns, ns);
    }
    if (seen == want) return seen;
    // as the communicator's barrier: spin briefly, then yield, then sleep, so oversubscribed hosts make progress
    if (spin < 64) continue;
    // (asked in the yields too: on a loaded host a thousand yields last seconds)
    if (interrupt_requested())
      fail_interrupted(comm_, leg == StatsLeg::combine ? WaitPhase::ll_combine : WaitPhase::ll_dispatch);
    if (spin < 1024) {
      std::this_thread::yield();
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) return seen;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void CpuEp::fail_communicator(WaitPhase phase, RankSet const& missing, uint64_t expected) {
  DeviceErrorBlock& block = *comm_.device_view().error;
  std::atomic_ref<uint32_t> status(block.status);
  uint32_t idle = 0;
  if (status.compare_exchange_strong(idle, 1U, std::memory_order_acq_rel)) {  // the first failure wins
    block.rank = rank_;
    block.peer = missing.count() == 1 ? missing.lowest() : -1;
    block.phase = static_cast<int32_t>(phase);
    block.expected = expected;
    block.observed = expected - 1;
    for (int const r : missing) block.absent[r / 32] |= 1U << (r % 32);
    status.store(kErrorTimeout, std::memory_order_release);
  }
  comm_.check_errors(nullptr);  // raises the recorded timeout and marks the communicator failed
  FERRY_THROW(Error, "ferry", "cpu backend: a timeout was recorded but check_errors raised nothing");
}

void CpuEp::sync(SyncPoint point, StatsLeg leg) {
  if (!own_sync_) {
    comm_.barrier(nullptr);
    return;
  }
  check_not_masked();
  uint64_t const epoch = ++epoch_;
  auto const start = std::chrono::steady_clock::now();
  auto* const mine = static_cast<uint64_t*>(sync_.local);
  std::size_t const arrival = static_cast<std::size_t>(rank_) * sizeof(uint64_t);
  WaitPhase const phase = leg == StatsLeg::combine ? WaitPhase::ll_combine : WaitPhase::ll_dispatch;
  // 1. this rank's arrival into every rank in the call (release: what it wrote before is visible with it), then the
  //    others' (acquire), each timed for the statistics
  for (int const r : active_)
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(sync_.of(r) + arrival))
        .store(epoch, std::memory_order_release);
  RankSet const present = wait_words(mine, 1, active_, epoch, leg);
  if (!masking_) {
    if (present != active_) fail_communicator(phase, active_ - present, epoch);
    return;
  }
  // 2. the rounds of estimates: the ranks of the call, the same on every rank that stays
  RankSet const agreed = agree(epoch, present, start, phase);
  RankSet const lost = active_ - agreed;
  if (lost.empty()) return;
  if (lost.test(rank_)) {
    self_view_ = (all_ranks_ - agreed) | (all_ranks_ - active_);
    self_masked_ = format_error(
        "ferry", __FILE__, __LINE__,
        concat("rank ", rank_, " is masked on this EpBuffer: at ", call_text(), " the other ranks waited ",
               comm_.device_view().timeout_ns / 1e9, " s (FERRY_TIMEOUT_S) for it and went on without rank(s) ",
               lost.text(), "; its calls are refused until every rank calls clear_mask()"));
    throw Error(self_masked_);
  }
  active_ = agreed;
  std::vector<int> const gone = lost.ranks();
  FERRY_LOG_WARN("rank ", rank_, ": ", describe_absent(gone, topology_), " masked at ", call_text(),
                 " (not there within FERRY_TIMEOUT_S); later calls skip them");
  if (point == SyncPoint::inner)
    FERRY_THROW(TimeoutError, "timeout",
                concat("rank ", rank_, " timed out in ", call_text(), " waiting for ", describe_absent(gone, topology_),
                       ", which entered the call but did not reach its next step within FERRY_TIMEOUT_S; no data of ",
                       "this call is returned. Rank masking is on: they are masked now and later calls skip them ",
                       "(this communicator stays usable)"));
}

void CpuEp::mask_self_ahead(int by, uint64_t epoch_seen) {
  self_view_ = all_ranks_ - active_;
  self_view_.set(rank_);
  self_masked_ = format_error(
      "ferry", __FILE__, __LINE__,
      concat("rank ", rank_, " is masked on this EpBuffer: at ", call_text(), " rank ", by, " was already ",
             epoch_seen == kRewritten ? std::string("in a later exchange")
                                      : concat("in exchange ", epoch_seen, " of the buffer"),
             ", past this call without this rank; its calls are refused until every rank "
             "calls clear_mask()"));
  throw Error(self_masked_);
}

RankSet CpuEp::agree(uint64_t epoch, RankSet const& present, std::chrono::steady_clock::time_point start,
                     WaitPhase phase) {
  auto const timeout = std::chrono::nanoseconds(comm_.device_view().timeout_ns);
  RankSet estimate = present;
  RankSet alive = present;  // the ranks this rank still hears from
  alive.reset(rank_);
  bool decided = false;
  for (int round = 2;; ++round) {
    // a. this rank's estimate into every rank in the call (the tag last, release: see kRewritten); a rank that
    //    decided writes it once more, marked, and goes on
    uint64_t const tag = epoch << 1 | (decided ? 1 : 0);
    for (int const r : active_) {
      if (r == rank_) continue;
      uint64_t* const slot = estimate_slot(r, rank_, round, epoch);
      open_slot(slot, 0);
      store_set(slot + 1, estimate, set_words_);
      publish_slot(slot, tag);
    }
    if (decided) return estimate;
    // NOTE: a round that ends undecided saw a rank die while writing (it reached some ranks and not others); one
    // more such death than the rounds take, and the ranks may hold different sets: nothing after can be trusted
    if (round > kMaskEstimateSlots) fail_communicator(phase, present - alive - RankSet::range(rank_, 1), epoch);
    // b. the estimates of this round from the ranks still heard from, or a decision of this round or the next
    //    (NOTE: the absolute deadlines leave a rank that arrived up to FERRY_TIMEOUT_S later, and each round after,
    //    half a timeout of margin: a live rank is never taken for a dead one)
    auto const deadline = start + timeout * round + timeout * (round - 1) / 2;
    RankSet heard;
    RankSet meet = estimate;
    std::optional<RankSet> adopted;
    for (uint64_t spin = 0; !adopted && heard != alive; ++spin) {
      for (int const s : alive) {
        for (int const ahead : {round, round + 1}) {
          uint64_t const* const slot = estimate_slot(rank_, s, ahead, epoch);
          uint64_t const seen = slot_tag(slot);
          if ((seen >> 1) < epoch) continue;  // not written yet (0: being written)
          RankSet const view = load_set(slot + 1, set_words_);
          // NOTE: a rank gets two exchanges ahead (the parity slot rewritten) only by going on without this rank
          bool const intact = slot_unchanged(slot, seen);
          if (!intact || (seen >> 1) > epoch) mask_self_ahead(s, intact ? seen >> 1 : kRewritten);
          if ((seen & 1) != 0) adopted = view;  // every decision of one agreement is the same set
          if (ahead == round && !heard.test(s)) {
            heard.set(s);
            meet &= view;
          }
        }
      }
      if (adopted || heard == alive) break;
      if (spin < 64) continue;
      if (interrupt_requested()) fail_interrupted(comm_, phase);
      if (spin < 1024) {
        std::this_thread::yield();
        continue;
      }
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // c. adopt a decision, or decide when every rank waited for was heard (else those not heard died, and leave the
    //    estimate: go round again)
    if (adopted) {
      estimate = *adopted;
    } else {
      estimate = meet - (alive - heard);
      decided = heard == alive;
      alive = heard;
      if (!decided) continue;
    }
    decided = true;
  }
}

void CpuEp::refuse_dispatch(cudaStream_t) {
  num_tokens_ = 0;
  join_call(CallKind::dispatch, true);
}

void CpuEp::refuse_combine(cudaStream_t) {
  join_call(CallKind::combine, true);
}

void CpuEp::report_drops(int64_t dropped, int first_rank, bool eager) {
  if (dropped > 0) {
    DeviceErrorBlock& block = *comm_.device_view().error;
    block.overflow_rows += static_cast<uint32_t>(std::min<int64_t>(dropped, UINT32_MAX - block.overflow_rows));
    if (block.overflow_rank == 0) block.overflow_rank = static_cast<uint32_t>(first_rank + 1);
  }
  if (eager) comm_.check_errors(nullptr);
}

int64_t CpuEp::agree_slot_drops(int64_t mine, int& first_rank) {
  // NOTE: a peer writes this rank's word again only in the receive half of its next dispatch, which cannot start
  // before this rank joined that call's entry exchange: the words read after this sync are this call's
  for (int const r : active_)
    std::atomic_ref<int64_t>(reinterpret_cast<int64_t*>(slot_drops_.of(r))[rank_])
        .store(mine, std::memory_order_relaxed);
  sync(SyncPoint::inner, StatsLeg::none);
  auto const* const words = reinterpret_cast<int64_t const*>(slot_drops_.local);
  int64_t total = 0;
  first_rank = -1;
  for (int const r : active_) {
    int64_t const theirs = std::atomic_ref<int64_t const>(words[r]).load(std::memory_order_relaxed);
    if (theirs > 0 && first_rank < 0) first_rank = r;
    total += theirs;
  }
  return total;
}

void CpuEp::mask_dispatch(std::vector<int64_t> const& ids, int num_tokens) {
  int64_t masked = 0;
  for (int t = 0; t < num_tokens; ++t) {
    dest_mask_[static_cast<std::size_t>(t)] &= active_;
    for (int k = 0; k < topk_; ++k)
      if (int64_t const id = ids[at(t, topk_) + k]; id >= 0 && !active(static_cast<int>(id / num_local_))) ++masked;
  }
  last_ids_ = ids;
  dispatch_active_ = active_;
  counts_of_masking_.last_dispatch_entries = masked;
  counts_of_masking_.dispatch_entries += masked;
}

void CpuEp::read_count_matrix(bool for_handle) {
  // NOTE: copied here, not in save_handle: a peer past this call's last barrier overwrites its row
  if (for_handle) {
    rank_counts_.resize(at(world_, world_));
    for (int s = 0; s < world_; ++s)
      for (int d = 0; d < world_; ++d)
        rank_counts_[at(s, world_) + static_cast<std::size_t>(d)] =
            active(s) && active(d) ? static_cast<int32_t>(count_row(s)[d]) : 0;
  }
  // every rank's rows past its capacity: every rank reads the same matrix, so every rank knows the call dropped (a rank
  // receives at most world * max_tokens_per_rank rows, so without a smaller capacity there is nothing to count)
  pending_row_drops_ = 0;
  pending_drop_rank_ = -1;
  if (!row_drops_possible(config_, world_)) return;
  for (int d = 0; d < world_; ++d) {
    if (!active(d)) continue;
    int64_t to_d = 0;
    for (int s = 0; s < world_; ++s) to_d += active(s) ? count_row(s)[d] : 0;
    if (to_d <= capacity_) continue;
    if (pending_drop_rank_ < 0) pending_drop_rank_ = d;
    pending_row_drops_ += to_d - capacity_;
  }
}

DispatchResult CpuEp::dispatch(DispatchArgs const& args, cudaStream_t) {
  check_not_masked();
  int const num_tokens = args.num_tokens;
  counts_host_ = args.expert_counts_host;

  // 1. the ids (checked by EpBuffer: in [-1, num_experts), distinct per token)
  std::vector<int64_t> const ids = host_topk_ids(config_, args);

  // 2. destinations of every token, rows per destination (none to a masked rank)
  dest_mask_.assign(static_cast<std::size_t>(num_tokens), RankSet());
  std::vector<int64_t> sends(static_cast<std::size_t>(world_), 0);
  for (int t = 0; t < num_tokens; ++t) {
    RankSet mask;
    for (int k = 0; k < topk_; ++k) {
      int64_t const id = ids[at(t, topk_) + k];
      if (id >= 0) mask.set(static_cast<int>(id / num_local_));
    }
    mask &= active_;
    dest_mask_[static_cast<std::size_t>(t)] = mask;
    for (int const d : mask) ++sends[static_cast<std::size_t>(d)];
  }
  num_tokens_ = num_tokens;

  // 3. count exchange: this rank publishes its row of the count matrix (no one reads it after the last barrier of the
  //    previous dispatch, so it is free to overwrite)
  std::memcpy(counts_.local, sends.data(), at(world_, sizeof(int64_t)));
  // counts visible everywhere (release/acquire in the barrier), and every rank in this call: else nothing moves.
  // The wait statistics time each source here: a late source is waited for at this exchange, its rows follow.
  join_call(CallKind::dispatch, false, StatsLeg::dispatch);

  // 3b. rank masking: the ranks the entry exchange masked get nothing either, and their entries are counted. The
  //     count rows already sent name them in their own columns only, which nobody reads; a masked source's row
  //     (stale, or of a later call) is not read either.
  if (masking_) mask_dispatch(ids, num_tokens);

  // 4. offsets: rank s's rows on rank d follow the rows of ranks 0..s-1 (rank-major order, no atomics)
  int64_t total_recv = 0;
  std::fill(dest_offset_.begin(), dest_offset_.end(), 0);
  for (int s = 0; s < rank_; ++s) {
    if (!active(s)) continue;
    int64_t const* row = count_row(s);
    for (int d = 0; d < world_; ++d) dest_offset_[static_cast<std::size_t>(d)] += row[d];
  }
  for (int s = 0; s < world_; ++s) total_recv += active(s) ? count_row(s)[rank_] : 0;
  int32_t const num_recv = static_cast<int32_t>(std::min<int64_t>(total_recv, capacity_));
  read_count_matrix(args.save_handle != nullptr);

  // 5. push each row and its metadata into its final slot on the destination; rows past its capacity are dropped
  //    (and counted by the receiver)
  // This rank's rows on rank d start at dest_offset_[d] and follow in token order.
  // NOTE: the wire row of each token is built once (quantized, or joined from the pre-quantized input) and pushed
  // to every destination, as the kernels do.
  auto const* x = static_cast<uint16_t const*>(args.x);
  auto const* payload = static_cast<uint8_t const*>(args.x);
  auto const* scales = static_cast<uint8_t const*>(args.x_scales);
  bool const prequantized = args.x_scales != nullptr;
  WireFormat const format = config_.dispatch_format;
  std::size_t const scale_row = static_cast<std::size_t>(dispatch_wire_.num_scales) * dispatch_wire_.scale_bytes;
  auto const wire_row = [&](int t) -> uint8_t const* {
    t /= args.x_repeat;  // the row of x the token sends (DispatchArgs::x_repeat)
    if (format == WireFormat::bf16) return reinterpret_cast<uint8_t const*>(x + at(t, hidden_));
    uint8_t* wire = wire_scratch_.data();
    if (!prequantized) {
      wire::quantize_row(format, x + at(t, hidden_), hidden_, wire);
      return wire;
    }
    ref::join_wire_row(dispatch_wire_, payload + at(t, 1) * dispatch_wire_.payload_bytes, scales + at(t, 1) * scale_row,
                       dispatch_wire_.has_token_scale ? args.x_token_scales + t : nullptr, wire);
    return wire;
  };
  // Across nodes, a row for another node goes to that node's rail instead (entry j of this node in its forward
  // area, the token's j-th row for that node), and the rail places it (forward_rows).
  link_bytes_.dispatch = {};
  std::size_t const meta_bytes = fwd_meta_bytes_;
  uint64_t const row_link_bytes = dispatch_wire_.row_bytes + meta_bytes;
  int const my_node = topology_.node_of(rank_);
  std::vector<int64_t> fwd_next(static_cast<std::size_t>(topology_.nodes), 0);
  std::vector<int64_t> next = dest_offset_;
  for (int t = 0; t < num_tokens; ++t) {
    RankSet const& mask = dest_mask_[static_cast<std::size_t>(t)];
    uint8_t const* wire = !mask.empty() ? wire_row(t) : nullptr;
    for (int n = 0; n < topology_.nodes && hierarchical_; ++n) {
      if (n == my_node || !mask.intersects(node_ranks(n))) continue;
      int const rail = rail_of(n, rank_, active_);  // live: the token has a live destination there
      std::size_t const entry =
          at(fwd_slot(rank_), max_tokens_) + static_cast<std::size_t>(fwd_next[static_cast<std::size_t>(n)]++);
      std::memcpy(fwd_x_.of(rail) + entry * dispatch_wire_.row_bytes, wire, dispatch_wire_.row_bytes);
      char* const meta = fwd_meta_.of(rail) + entry * meta_bytes;
      auto* const ids_out = reinterpret_cast<int32_t*>(meta);
      auto* const weights_out = reinterpret_cast<float*>(meta + at(topk_, 4));
      for (int k = 0; k < topk_; ++k) {
        ids_out[k] = static_cast<int32_t>(ids[at(t, topk_) + k]);
        weights_out[k] = args.topk_weights[at(t, topk_) + k];
      }
      *reinterpret_cast<int32_t*>(meta + at(topk_, 8)) = t;
      link_bytes_.dispatch.network_bytes += row_link_bytes;
      link_bytes_.dispatch.network_messages += 1;
    }
    for (int const d : mask) {
      if (hierarchical_ && !on_my_node(d)) continue;
      int64_t const row = next[static_cast<std::size_t>(d)]++;
      if (row >= capacity_) continue;
      if (d != rank_ && on_my_node(d)) link_bytes_.dispatch.nvlink_bytes += row_link_bytes;
      if (!on_my_node(d)) {  // direct route: one put per (token, remote rank)
        link_bytes_.dispatch.network_bytes += row_link_bytes;
        link_bytes_.dispatch.network_messages += 1;
      }
      std::memcpy(recv_x_.of(d) + at(row, 1) * dispatch_wire_.row_bytes, wire, dispatch_wire_.row_bytes);
      auto* const idx = reinterpret_cast<int32_t*>(recv_idx_.of(d)) + at(row, topk_);
      auto* const weights = reinterpret_cast<float*>(recv_weights_.of(d)) + at(row, topk_);
      int64_t const lo = static_cast<int64_t>(d) * num_local_;
      for (int k = 0; k < topk_; ++k) {
        int64_t const id = ids[at(t, topk_) + k];
        bool const local = id >= lo && id < lo + num_local_;
        idx[k] = local ? static_cast<int32_t>(id - lo) : -1;
        weights[k] = local ? args.topk_weights[at(t, topk_) + k] : 0.0f;
      }
      auto* const src = reinterpret_cast<int32_t*>(recv_src_.of(d)) + at(row, 2);
      src[0] = rank_;
      src[1] = t;
    }
  }
  if (hierarchical_) {
    for (int n = 0; n < topology_.nodes; ++n) {
      int const rail = rail_of(n, rank_, active_);
      if (n == my_node || rail < 0) continue;
      reinterpret_cast<int64_t*>(fwd_count_.of(rail))[fwd_slot(rank_)] = fwd_next[static_cast<std::size_t>(n)];
    }
    sync(SyncPoint::inner, StatsLeg::none);  // every forwarded row is in its rail's forward area
    forward_rows();
  }
  sync(SyncPoint::inner, StatsLeg::none);  // every row has landed
  num_recv_ = num_recv;
  // NOTE: low-latency mode always fills the expert-major layout (its output contract).
  pending_expand_ = args.expand || low_latency_;
  pending_eager_ = args.eager;
  last_dispatch_ = LastDispatch{DispatchRan::dispatch, args.expand, args.return_recv_hook};
  if (args.return_recv_hook) {
    // the send half is done: this rank's rows are on every destination. Views are valid after complete_dispatch.
    DispatchResult pending;
    pending.recv_capacity = capacity_;
    return pending;
  }
  return receive_dispatch();
}

DispatchResult CpuEp::complete_dispatch(cudaStream_t stream) {
  FERRY_CHECK_INPUT(stream == nullptr, "the cpu backend runs on the host: stream must be null, got ",
                    static_cast<void*>(stream));
  check_not_masked();
  return receive_dispatch();
}

DispatchResult CpuEp::receive_dispatch() {
  int32_t const num_recv = num_recv_;
  bool const expand = pending_expand_;
  // 6. receiver: the expert-major layout from the rows that arrived
  auto const* recv_idx = reinterpret_cast<int32_t const*>(recv_idx_.local);
  auto const* recv_src = reinterpret_cast<int32_t const*>(recv_src_.local);
  // NOTE: copied into storage sized once (not assigned): DispatchResult hands out pointers into these vectors, and a
  // view the caller kept from an earlier call must stay valid memory (bindings cache such views).
  ref::ExpertLayout fresh =
      ref::expert_layout(config_, world_, num_recv, std::span<int32_t const>(recv_idx, at(num_recv, topk_)),
                         ref::own_first_row(std::span<int32_t const>(recv_src, at(num_recv, 2)), num_recv, rank_));
  keep_storage_copy(fresh.expert_counts, layout_.expert_counts);
  keep_storage_copy(fresh.recv_slot, layout_.recv_slot);
  keep_storage_copy(fresh.expert_src_row, layout_.expert_src_row);
  layout_.expert_slots = fresh.expert_slots;
  layout_.dropped_slots = fresh.dropped_slots;
  // the delivered rows: bf16 rows are the landing zone itself; quantized rows are delivered as payload + scales or
  // dequantized (ll delivers the expert-major layout only)
  auto const* landing = static_cast<uint8_t const*>(recv_x_.local);
  std::size_t const wire_bytes = dispatch_wire_.row_bytes;
  WireFormat const format = config_.dispatch_format;
  bool const quantized_out = config_.delivers_quantized();
  auto const deliver_row = [&](uint8_t const* wire, uint8_t* out) {
    if (quantized_out)
      std::memcpy(out, wire, out_row_bytes_);
    else if (format == WireFormat::bf16)
      std::memcpy(out, wire, row_bytes_);
    else
      wire::dequantize_row(format, wire, hidden_, reinterpret_cast<uint16_t*>(out));
  };
  if (!low_latency_ && format != WireFormat::bf16) {
    for (int i = 0; i < num_recv; ++i)
      deliver_row(landing + at(i, 1) * wire_bytes, recv_out_.data() + at(i, 1) * out_row_bytes_);
    if (quantized_out) {
      wire::write_scale_tensor(format, config_.recv_scale_layout, landing, wire_bytes, capacity_, hidden_,
                               recv_scales_.data());
      if (dispatch_wire_.has_token_scale)
        wire::write_token_scales(format, landing, wire_bytes, capacity_, hidden_, recv_token_scales_.data());
    }
  }
  if (expand) {
    std::size_t const scale_tensor =
        quantized_out ? scale_tensor_bytes(format, config_.recv_scale_layout, slots_, hidden_) : 0;
    for (int e = 0; e < num_local_; ++e) {
      int const filled = std::min(layout_.expert_counts[static_cast<std::size_t>(e)], slots_);
      for (int s = 0; s < filled; ++s) {
        int32_t const row = layout_.expert_src_row[at(e, slots_) + s];
        uint8_t const* wire = landing + at(row, 1) * wire_bytes;
        deliver_row(wire, reinterpret_cast<uint8_t*>(expert_x_.data()) +
                              at(static_cast<int64_t>(e) * slots_ + s, 1) * out_row_bytes_);
        if (quantized_out) std::memcpy(gather_scratch_.data() + at(s, 1) * wire_bytes, wire, wire_bytes);
      }
      if (quantized_out) {
        // NOTE: unfilled slots' scale entries are unspecified (the kernels leave them); zero rows here
        std::memset(gather_scratch_.data() + at(filled, 1) * wire_bytes, 0, at(slots_ - filled, 1) * wire_bytes);
        wire::write_scale_tensor(format, config_.recv_scale_layout, gather_scratch_.data(), wire_bytes, slots_, hidden_,
                                 expert_scales_.data() + at(e, 1) * scale_tensor);
        if (dispatch_wire_.has_token_scale)
          wire::write_token_scales(format, gather_scratch_.data(), wire_bytes, slots_, hidden_,
                                   expert_token_scales_.data() + at(e, slots_));
      }
    }
  }
  DispatchResult result;
  result.recv_x = low_latency_                                  ? nullptr
                  : config_.dispatch_format == WireFormat::bf16 ? recv_x_.local
                                                                : static_cast<void*>(recv_out_.data());
  result.recv_row_bytes = out_row_bytes_;
  if (!low_latency_ && config_.delivers_quantized()) {
    result.recv_scales = recv_scales_.data();
    if (dispatch_wire_.has_token_scale) result.recv_token_scales = recv_token_scales_.data();
  }
  result.recv_topk_idx = reinterpret_cast<int32_t*>(recv_idx_.local);
  result.recv_topk_weights = reinterpret_cast<float*>(recv_weights_.local);
  result.recv_src = reinterpret_cast<int32_t*>(recv_src_.local);
  result.num_recv = &num_recv_;
  result.num_recv_host = num_recv_;  // calls are synchronous on cpu: known whether eager or not
  result.expert_counts = layout_.expert_counts.data();
  if (counts_host_ != nullptr) std::copy(layout_.expert_counts.begin(), layout_.expert_counts.end(), counts_host_);
  result.recv_capacity = capacity_;
  result.masked_entries = masking_ ? counts_of_masking_.last_dispatch_entries : 0;
  if (expand) {
    result.expert_x = expert_x_.data();
    result.expert_src_row = layout_.expert_src_row.data();
    result.expert_slots = slots_;
    if (config_.delivers_quantized()) {
      result.expert_scales = expert_scales_.data();
      if (dispatch_wire_.has_token_scale) result.expert_token_scales = expert_token_scales_.data();
    }
  }

  // 7. drops over every rank: rows past a receive capacity, and with expand, entries past expert_capacity (an
  //    InputError on every rank: now when eager, else at the next check; EpBuffer refuses combines over the layout)
  int slot_rank = -1;
  int64_t const slot_drops = slots_can_drop_ ? agree_slot_drops(expand ? layout_.dropped_slots : 0, slot_rank) : 0;
  int64_t const dropped = pending_row_drops_ + slot_drops;
  int const first = pending_drop_rank_ < 0 ? slot_rank
                    : slot_rank < 0        ? pending_drop_rank_
                                           : std::min(pending_drop_rank_, slot_rank);
  result.dropped_rows = dropped;
  report_drops(dropped, first, pending_eager_);
  return result;
}

std::vector<int> CpuEp::relayed_sources(RankSet const& live) const {
  std::vector<int> sources;
  int const my_node = topology_.node_of(rank_);
  for (int s = 0; s < world_; ++s)
    if (topology_.node_of(s) != my_node && live.test(s) && rail_of(my_node, s, live) == rank_) sources.push_back(s);
  return sources;
}

void CpuEp::forward_rows() {
  // This rank is the rail of node my_node for the source of its local index on every other node m (with masking: and
  // for the sources whose rail of that index is masked, rail_of). A source's rows on local rank l follow the rows of
  // every lower source there (the count matrix), in token order, as a source places its own rows: so the rows land
  // exactly where a direct push would put them.
  auto const* counts = reinterpret_cast<int64_t const*>(fwd_count_.local);
  int const my_node = topology_.node_of(rank_);
  int const local = topology_.local;
  uint64_t const row_link_bytes = dispatch_wire_.row_bytes + fwd_meta_bytes_;
  std::vector<int64_t> next(static_cast<std::size_t>(local));
  for (int const source : relayed_sources(active_)) {
    std::size_t const block = fwd_slot(source);
    int64_t const num = counts[block];
    fwd_num_[block] = num;
    for (int l = 0; l < local; ++l) {
      int64_t offset = 0;
      for (int s = 0; s < source; ++s) offset += active(s) ? count_row(s)[my_node * local + l] : 0;
      next[static_cast<std::size_t>(l)] = offset;
    }
    for (int64_t j = 0; j < num; ++j) {
      std::size_t const entry = at(static_cast<int64_t>(block), max_tokens_) + static_cast<std::size_t>(j);
      uint8_t const* wire = reinterpret_cast<uint8_t const*>(fwd_x_.local) + entry * dispatch_wire_.row_bytes;
      char const* const meta = static_cast<char const*>(fwd_meta_.local) + entry * fwd_meta_bytes_;
      auto const* ids = reinterpret_cast<int32_t const*>(meta);
      auto const* weights = reinterpret_cast<float const*>(meta + at(topk_, 4));
      int32_t const token = *reinterpret_cast<int32_t const*>(meta + at(topk_, 8));
      for (int l = 0; l < local; ++l) {
        int const d = my_node * local + l;
        int64_t const lo = static_cast<int64_t>(d) * num_local_;
        bool hit = false;
        for (int k = 0; k < topk_; ++k) hit = hit || (ids[k] >= lo && ids[k] < lo + num_local_);
        hit = hit && active(d);  // nothing for a masked rank
        int32_t placed = -1;
        if (hit) {
          int64_t const row = next[static_cast<std::size_t>(l)]++;
          if (row < capacity_) {
            placed = static_cast<int32_t>(row);
            std::memcpy(recv_x_.of(d) + at(row, 1) * dispatch_wire_.row_bytes, wire, dispatch_wire_.row_bytes);
            auto* const idx = reinterpret_cast<int32_t*>(recv_idx_.of(d)) + at(row, topk_);
            auto* const w = reinterpret_cast<float*>(recv_weights_.of(d)) + at(row, topk_);
            for (int k = 0; k < topk_; ++k) {
              bool const mine = ids[k] >= lo && ids[k] < lo + num_local_;
              idx[k] = mine ? static_cast<int32_t>(ids[k] - lo) : -1;
              w[k] = mine ? weights[k] : 0.0f;
            }
            auto* const src = reinterpret_cast<int32_t*>(recv_src_.of(d)) + at(row, 2);
            src[0] = source;
            src[1] = token;
            if (d != rank_) link_bytes_.dispatch.nvlink_bytes += row_link_bytes;
          }
        }
        fwd_rows_[entry * static_cast<std::size_t>(local) + static_cast<std::size_t>(l)] = placed;
      }
    }
  }
}

void CpuEp::reduce_forwarded(WireFormat format) {
  // One row per forwarded entry: its node's rows summed in fp32, local ranks ascending, rounded, in combine_format.
  // The sources are those of the dispatch (its rails); a rank masked since has written no rows and adds nothing.
  int const my_node = topology_.node_of(rank_);
  int const local = topology_.local;
  std::size_t const wire_bytes = combine_wire_.row_bytes;
  for (int const source : relayed_sources(dispatch_active_)) {
    if (!active(source)) continue;  // masked since the dispatch: nobody reads its rows
    std::size_t const block = fwd_slot(source);
    for (int64_t j = 0; j < fwd_num_[block]; ++j) {
      std::size_t const entry = at(static_cast<int64_t>(block), max_tokens_) + static_cast<std::size_t>(j);
      std::fill(scratch_.begin(), scratch_.end(), 0.0f);
      bool reached = false;
      for (int l = 0; l < local; ++l) {
        int32_t const row = fwd_rows_[entry * static_cast<std::size_t>(local) + static_cast<std::size_t>(l)];
        int const d = my_node * local + l;
        if (row < 0 || !active(d)) continue;
        ref::accumulate_row(hidden_,
                            reinterpret_cast<uint16_t const*>(combine_rows_.of(d) + at(row, 1) * combine_stride_),
                            scratch_.data());
        reached = true;
      }
      if (!reached) continue;  // every row of the token on this node was dropped (or masked): the source adds nothing
      ref::round_row(hidden_, scratch_.data(), row_scratch_.data());
      uint8_t* const out = reinterpret_cast<uint8_t*>(net_rows_.local) + entry * wire_bytes;
      if (format == WireFormat::bf16)
        std::memcpy(out, row_scratch_.data(), row_bytes_);
      else
        wire::quantize_row(format, row_scratch_.data(), hidden_, out);
      link_bytes_.combine.network_bytes += wire_bytes;
      link_bytes_.combine.network_messages += 1;
    }
  }
}

void CpuEp::combine(CombineArgs const& args, cudaStream_t) {
  run_combine(args, false, false);
}

void CpuEp::combine_unweighted(CombineArgs const& args, bool y_fp32, cudaStream_t) {
  run_combine(args, true, y_fp32);
}

void CpuEp::run_combine(CombineArgs const& args, bool unit_weights, bool y_fp32) {
  // NOTE: EpBuffer validated the call (validate_combine_args, refused on every rank): it follows a dispatch that
  // succeeded, and an expert-major one follows an expanded dispatch, whose layout_ holds the slots.
  check_not_masked();
  bool const expert_major = args.layout == CombineLayout::expert_major;

  // 1. receiver: the row each received row sends back, in this rank's send-back area
  auto* const out = static_cast<uint8_t*>(combine_rows_.local);
  WireFormat const format = config_.combine_format;
  std::size_t const wire_bytes = combine_wire_.row_bytes;
  auto const* expert_out = static_cast<uint16_t const*>(args.x);
  auto const* idx = reinterpret_cast<int32_t const*>(recv_idx_.local);
  std::vector<float> const ones(unit_weights ? static_cast<std::size_t>(topk_) : 0, 1.0f);
  auto const* weights = reinterpret_cast<float const*>(recv_weights_.local);
  auto const* recv_src = reinterpret_cast<int32_t const*>(recv_src_.local);
  link_bytes_.combine = {};
  for (int i = 0; i < num_recv_; ++i) {
    // the bf16 row this received row sends back, then its wire row (bf16: the row itself)
    uint16_t const* row = nullptr;
    if (expert_major) {
      ref::reduce_row(hidden_, topk_, slots_, idx + at(i, topk_), layout_.recv_slot.data() + at(i, topk_),
                      unit_weights ? ones.data() : weights + at(i, topk_), expert_out, scratch_.data(),
                      row_scratch_.data());
      row = row_scratch_.data();
    } else {
      row = expert_out + at(i, hidden_);
    }
    uint8_t* wire = out + at(i, 1) * combine_stride_;
    int const source = recv_src[at(i, 2)];
    if (hierarchical_ && !on_my_node(source)) {
      // for the rail of this node (local index of the source): the bf16 row, which it sums with its node's
      std::memcpy(wire, row, row_bytes_);
      if (rail_of(topology_.node_of(rank_), source, dispatch_active_) != rank_)
        link_bytes_.combine.nvlink_bytes += row_bytes_;
      continue;
    }
    if (format == WireFormat::bf16)
      std::memcpy(wire, row, row_bytes_);
    else
      wire::quantize_row(format, row, hidden_, wire);
    if (source != rank_ && on_my_node(source)) link_bytes_.combine.nvlink_bytes += wire_bytes;
    if (!on_my_node(source)) {  // direct route
      link_bytes_.combine.network_bytes += wire_bytes;
      link_bytes_.combine.network_messages += 1;
    }
  }
  // every rank's rows are ready, and every rank in this call: else nothing is summed
  join_call(CallKind::combine, false, StatsLeg::combine);
  if (hierarchical_) {
    reduce_forwarded(format);
    sync(SyncPoint::inner, StatsLeg::none);  // every rail's rows are ready
  }
  if (masking_) {
    // what this combine's y misses: every entry of a masked rank, and (forward route) every entry that would come
    // back through a rail masked since the dispatch
    int64_t missed = 0;
    int const my_node = topology_.node_of(rank_);
    for (std::size_t i = 0; i < last_ids_.size(); ++i) {
      int64_t const id = last_ids_[i];
      if (id < 0) continue;
      int const d = static_cast<int>(id / num_local_);
      int const n = topology_.node_of(d);
      bool const via_lost_rail = hierarchical_ && n != my_node && !active(rail_of(n, rank_, dispatch_active_));
      missed += !active(d) || via_lost_rail;
    }
    counts_of_masking_.last_combine_entries = missed;
    counts_of_masking_.combine_entries += missed;
  }
  pending_y_ = args.y;
  pending_y_fp32_ = y_fp32;
  pending_group_ = args.group;
  pending_group_weights_ = args.group_weights;
  pending_eager_ = args.eager;
  last_combine_ = LastCombine{true, unit_weights, expert_major, args.return_recv_hook};
  if (!args.return_recv_hook) receive_combine();
}

void CpuEp::complete_combine(cudaStream_t stream) {
  FERRY_CHECK_INPUT(stream == nullptr, "the cpu backend runs on the host: stream must be null, got ",
                    static_cast<void*>(stream));
  check_not_masked();
  receive_combine();
}

void CpuEp::receive_combine() {
  // 2. source: pull and sum this rank's rows over the destinations in ascending order (rows beyond a destination's
  //    capacity were never delivered and add nothing)
  auto* const y = static_cast<uint16_t*>(pending_y_);
  auto* const y_fp32 = static_cast<float*>(pending_y_);
  WireFormat const format = config_.combine_format;
  std::vector<float> values(static_cast<std::size_t>(hidden_));
  auto const add_row = [&](uint8_t const* sent) {
    if (format == WireFormat::bf16) {
      ref::accumulate_row(hidden_, reinterpret_cast<uint16_t const*>(sent), scratch_.data());
      return;
    }
    wire::dequantize_row(format, sent, hidden_, values.data());
    for (int h = 0; h < hidden_; ++h) scratch_[static_cast<std::size_t>(h)] += values[static_cast<std::size_t>(h)];
  };
  // nodes ascending; the own node's ranks one by one, every other node's one row from its rail (ref::, "Across
  // nodes"); one node: the ranks ascending
  int const my_node = topology_.node_of(rank_);
  int const local = topology_.local;
  std::vector<int64_t> next = dest_offset_;
  std::vector<int64_t> fwd_next(static_cast<std::size_t>(topology_.nodes), 0);
  // CombineArgs::group: y[u] = sum over j ascending of w(u * group + j) * (that token's fp32 row), each product
  // rounded to fp32 before its sum; a token no row came back for adds nothing
  bool const grouped = pending_group_weights_ != nullptr;
  std::vector<float> group_sum(grouped ? static_cast<std::size_t>(hidden_) : 0);
  bool added = false;
  auto const add = [&](uint8_t const* sent) {
    added = true;
    add_row(sent);
  };
  for (int t = 0; t < num_tokens_; ++t) {
    std::fill(scratch_.begin(), scratch_.end(), 0.0f);
    added = false;
    // the dispatch's destinations (what the rows and rails were laid out by); a rank masked since adds nothing
    RankSet const& mask = dest_mask_[static_cast<std::size_t>(t)];
    for (int n = 0; n < topology_.nodes; ++n) {
      if (hierarchical_ && n != my_node && mask.intersects(node_ranks(n))) {
        int64_t const j = fwd_next[static_cast<std::size_t>(n)]++;
        bool reached = false;
        for (int d = n * local; d < (n + 1) * local; ++d)
          if (mask.test(d)) reached = (next[static_cast<std::size_t>(d)]++ < capacity_ && active(d)) || reached;
        int const rail = rail_of(n, rank_, dispatch_active_);
        if (!reached || !active(rail)) continue;
        add(reinterpret_cast<uint8_t const*>(net_rows_.of(rail)) +
            (at(static_cast<int64_t>(fwd_slot(rank_)), max_tokens_) + static_cast<std::size_t>(j)) *
                combine_wire_.row_bytes);
        continue;
      }
      for (int d = n * local; d < (n + 1) * local; ++d) {
        if (!mask.test(d)) continue;
        int64_t const row = next[static_cast<std::size_t>(d)]++;
        if (row >= capacity_ || !active(d)) continue;
        add(reinterpret_cast<uint8_t const*>(combine_rows_.of(d)) + at(row, 1) * combine_stride_);
      }
    }
    if (grouped) {
      if (t % pending_group_ == 0) std::fill(group_sum.begin(), group_sum.end(), 0.0f);
      if (added) {
        float const w = pending_group_weights_[t];
        for (std::size_t h = 0; h < group_sum.size(); ++h) {
          float const product = w * scratch_[h];
          group_sum[h] += product;
        }
      }
      if (t % pending_group_ == pending_group_ - 1)
        ref::round_row(hidden_, group_sum.data(), y + at(t / pending_group_, hidden_));
      continue;
    }
    if (pending_y_fp32_)
      std::copy(scratch_.begin(), scratch_.end(), y_fp32 + at(t, hidden_));
    else
      ref::round_row(hidden_, scratch_.data(), y + at(t, hidden_));
  }
  sync(SyncPoint::exit, StatsLeg::none);  // every source has read the rows: the areas may be reused
  if (pending_eager_) comm_.check_errors(nullptr);
}

std::unique_ptr<HandleStorage> CpuEp::make_handle_storage(void*) const {
  return std::make_unique<CpuHandle>();
}

void CpuEp::save_handle(HandleState& handle, DispatchArgs const& args, cudaStream_t) {
  auto& h = static_cast<CpuHandle&>(*handle.storage);
  h.ids = host_topk_ids(config_, args);
  h.weights.assign(args.topk_weights, args.topk_weights + h.ids.size());
  h.dest_mask = dest_mask_;
  h.dest_offset = dest_offset_;
  h.num_recv = num_recv_;
  std::size_t const entries = at(num_recv_, topk_);
  auto const* idx = reinterpret_cast<int32_t const*>(recv_idx_.local);
  auto const* weights = reinterpret_cast<float const*>(recv_weights_.local);
  auto const* src = reinterpret_cast<int32_t const*>(recv_src_.local);
  h.recv_idx.assign(idx, idx + entries);
  h.recv_weights.assign(weights, weights + entries);
  h.recv_src.assign(src, src + at(num_recv_, 2));
  h.recv_slot.assign(layout_.recv_slot.begin(), layout_.recv_slot.begin() + static_cast<std::ptrdiff_t>(entries));
  h.expert_counts = layout_.expert_counts;
  h.fwd_rows = fwd_rows_;
  h.fwd_num = fwd_num_;
  h.rank_counts = rank_counts_;
}

void CpuEp::copy_rank_counts(HandleState const& handle, int32_t* out, cudaStream_t) const {
  auto const& h = static_cast<CpuHandle const&>(*handle.storage);
  std::copy(h.rank_counts.begin(), h.rank_counts.end(), out);
}

DispatchArgs CpuEp::cached_args(HandleState const& handle, DispatchArgs args) const {
  auto const& h = static_cast<CpuHandle const&>(*handle.storage);
  args.topk_idx = h.ids.data();
  args.topk_idx_type = IndexType::int64;
  args.topk_weights = h.weights.data();
  return args;
}

void CpuEp::restore_handle(HandleState const& handle, cudaStream_t) {
  auto const& h = static_cast<CpuHandle const&>(*handle.storage);
  num_tokens_ = handle.num_tokens;
  dest_mask_ = h.dest_mask;
  dest_offset_ = h.dest_offset;
  num_recv_ = h.num_recv;
  std::copy(h.recv_idx.begin(), h.recv_idx.end(), static_cast<int32_t*>(recv_idx_.local));
  std::copy(h.recv_weights.begin(), h.recv_weights.end(), static_cast<float*>(recv_weights_.local));
  std::copy(h.recv_src.begin(), h.recv_src.end(), static_cast<int32_t*>(recv_src_.local));
  std::copy(h.recv_slot.begin(), h.recv_slot.end(), layout_.recv_slot.begin());
  std::copy(h.expert_counts.begin(), h.expert_counts.end(), layout_.expert_counts.begin());
  fwd_rows_ = h.fwd_rows;
  fwd_num_ = h.fwd_num;
}

void CpuEp::combine_backward_weights(HandleState const&, void const* x, float* grad_w, bool eager, cudaStream_t) {
  exchange_grad_weights(x, grad_w, false, eager);
}

void CpuEp::refuse_combine_backward_weights(cudaStream_t) {
  exchange_grad_weights(nullptr, nullptr, true, false);
}

void CpuEp::exchange_grad_weights(void const* x, float* grad_w, bool refused, bool eager) {
  // 1. this rank's gradient area is zeroed before the barrier, after which the ranks holding its tokens' experts
  //    write into it (an entry nobody writes, an id of -1 or a dropped row, stays 0)
  std::fill_n(static_cast<float*>(grad_w_.local), at(config_.max_tokens_per_rank, topk_), 0.0f);
  join_call(CallKind::grad_weights, false);
  // 2. per filled slot: the dot of the gradient row (the cached dispatch delivered grad_y there) with the expert
  //    output, into the source's area at (token, k); then the slot becomes w * grad_y
  if (!refused) {
    auto const* idx = reinterpret_cast<int32_t const*>(recv_idx_.local);
    auto const* weights = reinterpret_cast<float const*>(recv_weights_.local);
    auto const* src = reinterpret_cast<int32_t const*>(recv_src_.local);
    auto* const slots = reinterpret_cast<uint16_t*>(expert_x_.data());
    auto const* out = static_cast<uint16_t const*>(x);
    for (int i = 0; i < num_recv_; ++i)
      for (int k = 0; k < topk_; ++k) {
        int32_t const e = idx[at(i, topk_) + k];
        int32_t const slot = layout_.recv_slot[at(i, topk_) + k];
        if (e < 0 || slot < 0) continue;
        std::size_t const row = at(static_cast<int64_t>(e) * slots_ + slot, hidden_);
        uint16_t* const g = slots + row;
        if (out != nullptr) {
          float const dot = ref::dot_warp(hidden_, g, out + row);
          reinterpret_cast<float*>(grad_w_.of(src[at(i, 2)]))[at(src[at(i, 2) + 1], topk_) + k] = dot;
        }
        float const w = weights[at(i, topk_) + k];
        for (int h = 0; h < hidden_; ++h) g[h] = ref::float_to_bf16(w * ref::bf16_to_float(g[h]));
      }
  }
  comm_.barrier(nullptr);  // every dot has landed
  if (grad_w != nullptr) std::copy_n(static_cast<float const*>(grad_w_.local), at(num_tokens_, topk_), grad_w);
  last_dispatch_ = LastDispatch{DispatchRan::combine_backward, false, false};
  comm_.barrier(nullptr);  // every rank has read its area: the next call may zero it
  if (eager) comm_.check_errors(nullptr);
}

CallLinkBytes CpuEp::link_bytes(cudaStream_t) const {
  return link_bytes_;
}

MaskStatus CpuEp::mask_status() const {
  MaskStatus status = counts_of_masking_;
  status.self = !self_masked_.empty();
  status.ranks = (status.self ? self_view_ : all_ranks_ - active_).ranks();
  return status;
}

void CpuEp::mask_ranks(std::vector<int> const& ranks) {
  for (int r : ranks) proposed_.set(r);  // EpBuffer checked the range
}

void CpuEp::clear_mask() {
  // Every rank, masked or not, brings its counters; all take the largest (those of the ranks that went on: a masked
  // rank's stopped when it was left out). The words in symmetric memory need no reset: arrivals are compared with
  // >= and verdicts carry their epoch, and every word written so far holds an epoch at most the largest.
  struct Counters {
    uint64_t epoch;
    uint64_t step;
    uint64_t calls[3];
  };
  Counters const mine{epoch_, step_, {calls_[0], calls_[1], calls_[2]}};
  std::vector<Counters> all(static_cast<std::size_t>(world_));
  comm_.bootstrap().allgather(&mine, all.data(), sizeof(Counters));
  for (Counters const& theirs : all) {
    epoch_ = std::max(epoch_, theirs.epoch);
    step_ = std::max(step_, theirs.step);
    for (int k = 0; k < 3; ++k) calls_[k] = std::max(calls_[k], theirs.calls[k]);
  }
  active_ = all_ranks_;
  dispatch_active_ = all_ranks_;
  proposed_ = RankSet();
  self_masked_.clear();
  self_view_ = RankSet();
  last_ids_.clear();
  num_tokens_ = 0;
  counts_of_masking_ = MaskStatus{};
  counts_of_masking_.enabled = true;
}

WaitStats CpuEp::wait_stats(cudaStream_t) const {
  return WaitStats{waits_[0], waits_[1]};
}

void CpuEp::reset_wait_stats(cudaStream_t) {
  for (auto& leg : waits_) std::fill(leg.begin(), leg.end(), PeerWaitStats{});
}

std::string CpuEp::explain() const {
  std::string dispatch;
  switch (last_dispatch_.ran) {
    case DispatchRan::none:
      dispatch = "dispatch: not called yet";
      break;
    case DispatchRan::combine_backward:
      dispatch = "combine_backward (cached dispatch of grad_y + weight step): cpu reference";
      break;
    case DispatchRan::dispatch:
      dispatch =
          low_latency_
              ? concat("dispatch: cpu reference, ll (", hierarchy(), "host push through shared memory + expert-major",
                       last_dispatch_.hook ? ", split: receive half in complete_dispatch" : "", ")")
              : concat("dispatch: cpu reference (", hierarchy(), "host push through shared memory, rank-major",
                       last_dispatch_.expand ? " + expand" : "", ")");
      break;
  }
  LastCombine const& c = last_combine_;
  std::string const combine =
      !c.ran
          ? std::string("combine: not called yet")
          : concat(
                c.unit_weights ? "dispatch_backward (combine of gradients): cpu reference" : "combine: cpu reference",
                low_latency_ ? ", ll" : "", " (", hierarchy(), "host pull-reduce through shared memory, ",
                c.expert_major ? "expert_major" : "rank_major", c.hook ? ", split: sum in complete_combine" : "", ")");
  return concat(dispatch, "\n", combine);
}

}  // namespace

std::unique_ptr<EpBackendImpl> make_cpu_ep(Communicator& comm, EpConfig const& config) {
  return std::make_unique<CpuEp>(comm, config);
}

}  // namespace ferry::detail
