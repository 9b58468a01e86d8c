#include "ep/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ferry/error.hpp"
#include "wire/codec.hpp"

namespace ferry::ref {
namespace {

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

// True when token row `idx` (topk ids) has a valid expert in [lo, hi).
bool reaches(int64_t const* idx, int topk, int64_t lo, int64_t hi) {
  for (int k = 0; k < topk; ++k)
    if (idx[k] >= lo && idx[k] < hi) return true;
  return false;
}

void check_world(int world, int rank, std::size_t num_inputs) {
  FERRY_CHECK_INPUT(world >= 1 && rank >= 0 && rank < world, "rank=", rank, " is outside [0, world=", world, ")");
  FERRY_CHECK_INPUT(num_inputs == static_cast<std::size_t>(world), "got ", num_inputs,
                    " per-rank inputs for world=", world, "; pass one per rank");
}

void check_received(int world, int rank, std::size_t num_inputs, std::size_t num_received) {
  check_world(world, rank, num_inputs);
  FERRY_CHECK_INPUT(num_received == static_cast<std::size_t>(world), "got ", num_received,
                    " received layouts for world=", world, "; pass every rank's dispatch result");
}

// For each token of source rank `source`, the row it landed on in `received` (-1 if it was not delivered there).
// Rows are rank-major, so the source's rows are one contiguous run, ordered by token.
std::vector<int> rows_of_source(RankDispatch const& received, int source, int num_tokens) {
  std::vector<int> rows(static_cast<std::size_t>(num_tokens), -1);
  for (int i = 0; i < received.num_recv; ++i) {
    if (received.recv_src[at(i, 2)] != source) continue;
    int const token = received.recv_src[at(i, 2) + 1];
    FERRY_CHECK_INPUT(token >= 0 && token < num_tokens, "received row ", i, " names token ", token, " of rank ", source,
                      ", which has ", num_tokens, " tokens");
    rows[static_cast<std::size_t>(token)] = i;
  }
  return rows;
}

// The source side shared by both combine layouts, before the final rounding (the order of reference.hpp, "Across
// nodes"): acc[t] = sum over the nodes ascending; the source's own node adds float(row_d(t)) (in combine_format) for
// each rank d of it ascending, every other node adds one row, its ranks' rows summed in fp32 (d ascending), rounded
// to bf16 and sent in combine_format. row_of(d, i, out) yields the bf16 row that rank d sends back for its received
// row i. One node: the sum over d ascending.
template <typename RowOf>
std::vector<float> source_sum_fp32(EpConfig const& config, Topology const& topology, int rank,
                                   std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                   RowOf&& row_of) {
  int const world = topology.world();
  check_received(world, rank, inputs.size(), received.size());
  int const hidden = config.hidden;
  int const num_tokens = inputs[static_cast<std::size_t>(rank)].num_tokens;
  std::vector<std::vector<int>> rows(static_cast<std::size_t>(world));
  for (int d = 0; d < world; ++d)
    rows[static_cast<std::size_t>(d)] = rows_of_source(received[static_cast<std::size_t>(d)], rank, num_tokens);

  std::vector<float> y(at(num_tokens, hidden), 0.0f);
  std::vector<uint16_t> row(static_cast<std::size_t>(hidden));
  std::vector<uint16_t> partial_row(static_cast<std::size_t>(hidden));
  std::vector<float> partial(static_cast<std::size_t>(hidden));
  std::vector<uint8_t> wire_scratch;
  std::vector<float> value_scratch;
  int const own_node = topology.node_of(rank);
  for (int t = 0; t < num_tokens; ++t) {
    float* const acc = y.data() + at(t, hidden);
    for (int n = 0; n < topology.nodes; ++n) {
      bool reached = false;
      if (n != own_node) std::fill(partial.begin(), partial.end(), 0.0f);
      for (int d = n * topology.local; d < (n + 1) * topology.local; ++d) {
        int const i = rows[static_cast<std::size_t>(d)][static_cast<std::size_t>(t)];
        if (i < 0) continue;
        uint16_t const* sent = row_of(d, i, row.data());
        if (n == own_node)
          accumulate_combined_row(config.combine_format, hidden, sent, wire_scratch, value_scratch, acc);
        else
          accumulate_row(hidden, sent, partial.data());
        reached = true;
      }
      if (n == own_node || !reached) continue;
      round_row(hidden, partial.data(), partial_row.data());
      accumulate_combined_row(config.combine_format, hidden, partial_row.data(), wire_scratch, value_scratch, acc);
    }
  }
  return y;
}

// ...rounded: y[t] = bf16(acc[t]).
template <typename RowOf>
std::vector<uint16_t> source_sum(EpConfig const& config, Topology const& topology, int rank,
                                 std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                 RowOf&& row_of) {
  std::vector<float> const acc = source_sum_fp32(config, topology, rank, inputs, received, row_of);
  std::vector<uint16_t> y(acc.size());
  for (std::size_t i = 0; i < acc.size(); ++i) y[i] = float_to_bf16(acc[i]);
  return y;
}

// Every rank's input with x replaced by grad_y[r] (the same routing): what combine_backward dispatches.
std::vector<RankInput> gradient_inputs(EpConfig const& config, std::span<RankInput const> inputs,
                                       std::span<std::vector<uint16_t> const> grad_y) {
  FERRY_CHECK_INPUT(grad_y.size() == inputs.size(), "got ", grad_y.size(), " grad_y for ", inputs.size(), " ranks");
  std::vector<RankInput> out(inputs.begin(), inputs.end());
  for (std::size_t r = 0; r < out.size(); ++r) {
    FERRY_CHECK_INPUT(grad_y[r].size() == at(out[r].num_tokens, config.hidden), "grad_y[", r, "] holds ",
                      grad_y[r].size(), " elements; num_tokens x hidden needs ", at(out[r].num_tokens, config.hidden));
    out[r].x = grad_y[r];
    out[r].x_wire.clear();
  }
  return out;
}

}  // namespace

// NOTE: the row loops are compiled twice, for x86-64 with FMA and for the baseline, and picked at load time: fmaf is
// one instruction with FMA and a libm call without it. Both round once, so the results are identical. Not under
// ThreadSanitizer: the clones' ifunc resolver runs while the program is relocated, before TSan's runtime is up, and
// its instrumented code crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define FERRY_ROW_LOOP __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FERRY_ROW_LOOP
#endif

FERRY_ROW_LOOP void reduce_row(int hidden, int topk, int expert_slots, int32_t const* local_idx, int32_t const* slot,
                               float const* weights, uint16_t const* expert_out, float* scratch, uint16_t* out) {
  for (int h = 0; h < hidden; ++h) scratch[h] = 0.0f;
  for (int k = 0; k < topk; ++k) {
    if (local_idx[k] < 0 || slot[k] < 0) continue;
    float const w = weights[k];
    uint16_t const* src = expert_out + (static_cast<std::size_t>(local_idx[k]) * expert_slots + slot[k]) * hidden;
    for (int h = 0; h < hidden; ++h) scratch[h] = std::fmaf(w, bf16_to_float(src[h]), scratch[h]);
  }
  round_row(hidden, scratch, out);
}

FERRY_ROW_LOOP void accumulate_row(int hidden, uint16_t const* row, float* acc) {
  for (int h = 0; h < hidden; ++h) acc[h] += bf16_to_float(row[h]);
}

void accumulate_combined_row(WireFormat format, int hidden, uint16_t const* row, std::vector<uint8_t>& wire_scratch,
                             std::vector<float>& value_scratch, float* acc) {
  if (format == WireFormat::bf16) {
    accumulate_row(hidden, row, acc);
    return;
  }
  wire_scratch.resize(wire_row_bytes(format, hidden));
  value_scratch.resize(static_cast<std::size_t>(hidden));
  wire::quantize_row(format, row, hidden, wire_scratch.data());
  wire::dequantize_row(format, wire_scratch.data(), hidden, value_scratch.data());
  for (int h = 0; h < hidden; ++h) acc[h] += value_scratch[static_cast<std::size_t>(h)];
}

FERRY_ROW_LOOP void round_row(int hidden, float const* acc, uint16_t* out) {
  for (int h = 0; h < hidden; ++h) out[h] = float_to_bf16(acc[h]);
}

void validate_topk_idx(EpConfig const& config, int rank, int num_tokens, std::span<int64_t const> topk_idx) {
  int const topk = config.topk;
  FERRY_CHECK_INPUT(topk_idx.size() >= at(num_tokens, topk), "rank ", rank, ": topk_idx holds ", topk_idx.size(),
                    " ids, num_tokens=", num_tokens, " x topk=", topk, " needs ", at(num_tokens, topk));
  for (int t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < topk; ++k) {
      int64_t const id = topk_idx[at(t, topk) + k];
      FERRY_CHECK_INPUT(id >= -1 && id < config.num_experts, "rank ", rank, ": topk_idx[", t, ", ", k, "]=", id,
                        " is outside [-1, num_experts=", config.num_experts,
                        "); use a global expert id, or -1 for no expert");
      // NOTE: a token picks distinct experts (as DeepEP's and NCCL EP's routers produce them): a repeated id would be
      // one (token, expert) pair counted twice, with two weights for one expert output. -1 may repeat.
      for (int j = 0; j < k && id >= 0; ++j)
        FERRY_CHECK_INPUT(topk_idx[at(t, topk) + j] != id, "rank ", rank, ": topk_idx[", t, ", ", k, "]=", id,
                          " repeats topk_idx[", t, ", ", j, "]; a token picks distinct experts (use -1 for an unused ",
                          "column)");
    }
  }
}

void validate_input(EpConfig const& config, int /*world*/, int rank, RankInput const& input) {
  FERRY_CHECK_INPUT(input.num_tokens >= 0 && input.num_tokens <= config.max_tokens_per_rank, "rank ", rank,
                    ": num_tokens=", input.num_tokens,
                    " is outside [0, max_tokens_per_rank=", config.max_tokens_per_rank,
                    "]; split the batch or raise max_tokens_per_rank");
  if (input.x_wire.empty()) {
    FERRY_CHECK_INPUT(input.x.size() == at(input.num_tokens, config.hidden), "rank ", rank, ": x holds ",
                      input.x.size(), " elements, num_tokens=", input.num_tokens, " x hidden=", config.hidden,
                      " needs ", at(input.num_tokens, config.hidden));
  } else {
    std::size_t const row_bytes = wire_row_bytes(config.dispatch_format, config.hidden);
    FERRY_CHECK_INPUT(config.dispatch_format != WireFormat::bf16, "rank ", rank,
                      ": pre-quantized input (x_wire) needs a quantized dispatch_format, not bf16");
    FERRY_CHECK_INPUT(input.x_wire.size() == at(input.num_tokens, static_cast<int64_t>(row_bytes)), "rank ", rank,
                      ": x_wire holds ", input.x_wire.size(), " bytes, num_tokens=", input.num_tokens,
                      " x wire_row_bytes=", row_bytes, " needs ",
                      at(input.num_tokens, static_cast<int64_t>(row_bytes)));
  }
  FERRY_CHECK_INPUT(input.topk_idx.size() == at(input.num_tokens, config.topk), "rank ", rank, ": topk_idx holds ",
                    input.topk_idx.size(), " ids, num_tokens=", input.num_tokens, " x topk=", config.topk, " needs ",
                    at(input.num_tokens, config.topk));
  FERRY_CHECK_INPUT(input.topk_weights.size() == at(input.num_tokens, config.topk), "rank ", rank,
                    ": topk_weights holds ", input.topk_weights.size(), " weights, num_tokens=", input.num_tokens,
                    " x topk=", config.topk, " needs ", at(input.num_tokens, config.topk));
  validate_topk_idx(config, rank, input.num_tokens, input.topk_idx);
}

int own_first_row(std::span<int32_t const> recv_src, int num_recv, int rank) {
  int row = 0;
  while (row < num_recv && recv_src[at(row, 2)] < rank) ++row;
  return row;
}

ExpertLayout expert_layout(EpConfig const& config, int world, int num_recv, std::span<int32_t const> recv_topk_idx,
                           int own_first_row) {
  int const topk = config.topk;
  int const num_local = config.num_local_experts(world);
  ExpertLayout layout;
  layout.expert_slots = config.expert_slots();
  layout.expert_counts.assign(static_cast<std::size_t>(num_local), 0);
  layout.recv_slot.assign(at(num_recv, topk), -1);
  layout.expert_src_row.assign(at(num_local, layout.expert_slots), -1);
  FERRY_CHECK(own_first_row >= 0 && own_first_row <= num_recv, "own_first_row=", own_first_row, " is outside [0, ",
              num_recv, "]");
  for (int q = 0; q < num_recv; ++q) {
    int const i = (own_first_row + q) % num_recv;  // own rows first, the rows of lower sources last
    for (int k = 0; k < topk; ++k) {
      int32_t const e = recv_topk_idx[at(i, topk) + k];
      if (e < 0) continue;
      FERRY_CHECK_INPUT(e < num_local, "received row ", i, " column ", k, " names local expert ", e, " of ", num_local);
      int32_t const slot = layout.expert_counts[static_cast<std::size_t>(e)]++;
      if (layout.expert_slots == 0) continue;  // no expert-major layout
      if (slot >= layout.expert_slots) {
        ++layout.dropped_slots;
        continue;
      }
      layout.recv_slot[at(i, topk) + k] = slot;
      layout.expert_src_row[at(e, layout.expert_slots) + slot] = i;
    }
  }
  return layout;
}

CallDrops call_drops(std::span<RankDispatch const> received, std::vector<bool> const& expanded) {
  FERRY_CHECK(received.size() == expanded.size(), "call_drops: ", received.size(), " ranks received but ",
              expanded.size(), " expand flags");
  CallDrops drops;
  for (std::size_t r = 0; r < received.size(); ++r) {
    int64_t const mine = received[r].dropped_rows + (expanded[r] ? received[r].dropped_slots : 0);
    if (mine > 0 && drops.first_rank < 0) drops.first_rank = static_cast<int>(r);
    drops.rows += mine;
  }
  return drops;
}

MaskedWorld without_ranks(EpConfig const& config, int world, std::span<RankInput const> inputs,
                          detail::RankSet const& masked) {
  int const num_local = config.num_local_experts(world);
  MaskedWorld out;
  out.inputs.assign(inputs.begin(), inputs.end());
  out.masked_entries.assign(static_cast<std::size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    RankInput& in = out.inputs[static_cast<std::size_t>(r)];
    if (masked.test(r)) {
      in = RankInput{};  // a masked rank sends nothing
      continue;
    }
    for (int64_t& id : in.topk_idx) {
      if (id < 0 || !masked.test(static_cast<int>(id / num_local))) continue;
      id = -1;
      ++out.masked_entries[static_cast<std::size_t>(r)];
    }
  }
  return out;
}

RankDispatch dispatch(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs) {
  check_world(world, rank, inputs.size());
  for (int s = 0; s < world; ++s) validate_input(config, world, s, inputs[static_cast<std::size_t>(s)]);
  int const hidden = config.hidden;
  int const topk = config.topk;
  int const num_local = config.num_local_experts(world);
  int64_t const lo = static_cast<int64_t>(rank) * num_local;
  int64_t const hi = lo + num_local;
  int const capacity = config.recv_capacity(world);

  // 1. rows in (source rank, source token) order: one per token with at least one expert on this rank
  std::size_t const wire_bytes = wire_row_bytes(config.dispatch_format, hidden);
  std::vector<std::vector<uint8_t>> source_wire(static_cast<std::size_t>(world));
  std::vector<std::pair<int, int>> rows;
  for (int s = 0; s < world; ++s) {
    source_wire[static_cast<std::size_t>(s)] = source_wire_rows(config, inputs[static_cast<std::size_t>(s)]);
    RankInput const& input = inputs[static_cast<std::size_t>(s)];
    for (int t = 0; t < input.num_tokens; ++t)
      if (reaches(input.topk_idx.data() + at(t, topk), topk, lo, hi)) rows.emplace_back(s, t);
  }
  RankDispatch out;
  out.num_recv = static_cast<int>(std::min<std::size_t>(rows.size(), static_cast<std::size_t>(capacity)));
  out.dropped_rows = static_cast<int>(rows.size()) - out.num_recv;

  // 2. the delivered rows: data, local expert ids (-1 elsewhere), weights (0 where -1), source
  out.recv_x.resize(at(out.num_recv, hidden));
  out.recv_wire.resize(at(out.num_recv, static_cast<int64_t>(wire_bytes)));
  out.recv_topk_idx.resize(at(out.num_recv, topk));
  out.recv_topk_weights.resize(at(out.num_recv, topk));
  out.recv_src.resize(at(out.num_recv, 2));
  for (int i = 0; i < out.num_recv; ++i) {
    auto const [s, t] = rows[static_cast<std::size_t>(i)];
    RankInput const& input = inputs[static_cast<std::size_t>(s)];
    uint8_t* wire = out.recv_wire.data() + at(i, static_cast<int64_t>(wire_bytes));
    std::memcpy(wire, source_wire[static_cast<std::size_t>(s)].data() + at(t, static_cast<int64_t>(wire_bytes)),
                wire_bytes);
    if (config.dispatch_format == WireFormat::bf16)
      std::memcpy(out.recv_x.data() + at(i, hidden), wire, wire_bytes);
    else
      wire::dequantize_row(config.dispatch_format, wire, hidden, out.recv_x.data() + at(i, hidden));
    for (int k = 0; k < topk; ++k) {
      int64_t const id = input.topk_idx[at(t, topk) + k];
      bool const local = id >= lo && id < hi;
      out.recv_topk_idx[at(i, topk) + k] = local ? static_cast<int32_t>(id - lo) : -1;
      out.recv_topk_weights[at(i, topk) + k] = local ? input.topk_weights[at(t, topk) + k] : 0.0f;
    }
    out.recv_src[at(i, 2)] = s;
    out.recv_src[at(i, 2) + 1] = t;
  }

  // 3. expert-major slots
  ExpertLayout layout =
      expert_layout(config, world, out.num_recv, out.recv_topk_idx, own_first_row(out.recv_src, out.num_recv, rank));
  out.expert_counts = std::move(layout.expert_counts);
  out.recv_slot = std::move(layout.recv_slot);
  out.expert_src_row = std::move(layout.expert_src_row);
  out.expert_slots = layout.expert_slots;
  out.dropped_slots = layout.dropped_slots;
  return out;
}

std::vector<uint16_t> expand(EpConfig const& config, int world, RankDispatch const& received) {
  int const hidden = config.hidden;
  int const num_local = config.num_local_experts(world);
  int const slots = received.expert_slots;
  std::vector<uint16_t> expert_x(at(static_cast<int64_t>(num_local) * slots, hidden), 0);
  for (int e = 0; e < num_local; ++e) {
    int const filled = std::min(received.expert_counts[static_cast<std::size_t>(e)], slots);
    for (int s = 0; s < filled; ++s) {
      int32_t const row = received.expert_src_row[at(e, slots) + s];
      std::memcpy(expert_x.data() + at(static_cast<int64_t>(e) * slots + s, hidden),
                  received.recv_x.data() + at(row, hidden), at(hidden, sizeof(uint16_t)));
    }
  }
  return expert_x;
}

std::vector<uint8_t> expand_wire(EpConfig const& config, int world, RankDispatch const& received) {
  std::size_t const row_bytes = wire_row_bytes(config.dispatch_format, config.hidden);
  int const num_local = config.num_local_experts(world);
  int const slots = received.expert_slots;
  FERRY_CHECK_INPUT(received.recv_wire.size() == at(received.num_recv, static_cast<int64_t>(row_bytes)),
                    "recv_wire holds ", received.recv_wire.size(), " bytes; num_recv x wire_row_bytes needs ",
                    at(received.num_recv, static_cast<int64_t>(row_bytes)));
  std::vector<uint8_t> out(at(static_cast<int64_t>(num_local) * slots, static_cast<int64_t>(row_bytes)), 0);
  for (int e = 0; e < num_local; ++e) {
    int const filled = std::min(received.expert_counts[static_cast<std::size_t>(e)], slots);
    for (int s = 0; s < filled; ++s) {
      int32_t const row = received.expert_src_row[at(e, slots) + s];
      std::memcpy(out.data() + at(static_cast<int64_t>(e) * slots + s, static_cast<int64_t>(row_bytes)),
                  received.recv_wire.data() + at(row, static_cast<int64_t>(row_bytes)), row_bytes);
    }
  }
  return out;
}

std::vector<uint8_t> source_wire_rows(EpConfig const& config, RankInput const& input) {
  if (!input.x_wire.empty()) return input.x_wire;
  int const hidden = config.hidden;
  std::size_t const row_bytes = wire_row_bytes(config.dispatch_format, hidden);
  std::vector<uint8_t> wire(at(input.num_tokens, static_cast<int64_t>(row_bytes)));
  if (config.dispatch_format == WireFormat::bf16) {
    if (!wire.empty()) std::memcpy(wire.data(), input.x.data(), wire.size());  // no tokens: both may be null
    return wire;
  }
  for (int t = 0; t < input.num_tokens; ++t)
    wire::quantize_row(config.dispatch_format, input.x.data() + at(t, hidden), hidden,
                        wire.data() + at(t, static_cast<int64_t>(row_bytes)));
  return wire;
}

QuantizedInput split_wire_rows(EpConfig const& config, std::span<uint8_t const> wire, int num_rows) {
  WireRowLayout const layout = wire_row_layout(config.dispatch_format, config.hidden);
  FERRY_CHECK_INPUT(config.dispatch_format != WireFormat::bf16, "split_wire_rows needs a quantized dispatch_format");
  FERRY_CHECK_INPUT(wire.size() >= at(num_rows, static_cast<int64_t>(layout.row_bytes)), "wire holds ", wire.size(),
                    " bytes, ", num_rows, " rows need ", at(num_rows, static_cast<int64_t>(layout.row_bytes)));
  std::size_t const scale_row = static_cast<std::size_t>(layout.num_scales) * layout.scale_bytes;
  QuantizedInput out;
  out.payload.resize(at(num_rows, static_cast<int64_t>(layout.payload_bytes)));
  out.scales.resize(at(num_rows, static_cast<int64_t>(scale_row)));
  if (layout.has_token_scale) out.token_scales.resize(static_cast<std::size_t>(num_rows));
  for (int r = 0; r < num_rows; ++r) {
    uint8_t const* row = wire.data() + at(r, static_cast<int64_t>(layout.row_bytes));
    std::memcpy(out.payload.data() + at(r, static_cast<int64_t>(layout.payload_bytes)), row, layout.payload_bytes);
    std::memcpy(out.scales.data() + at(r, static_cast<int64_t>(scale_row)), row + layout.scales_offset, scale_row);
    if (layout.has_token_scale)
      std::memcpy(&out.token_scales[static_cast<std::size_t>(r)], row + layout.token_scale_offset, sizeof(float));
  }
  return out;
}

std::vector<uint8_t> join_wire_rows(EpConfig const& config, QuantizedInput const& input, int num_rows) {
  WireRowLayout const layout = wire_row_layout(config.dispatch_format, config.hidden);
  FERRY_CHECK_INPUT(config.dispatch_format != WireFormat::bf16, "join_wire_rows needs a quantized dispatch_format");
  std::size_t const scale_row = static_cast<std::size_t>(layout.num_scales) * layout.scale_bytes;
  FERRY_CHECK_INPUT(input.payload.size() >= at(num_rows, static_cast<int64_t>(layout.payload_bytes)) &&
                        input.scales.size() >= at(num_rows, static_cast<int64_t>(scale_row)) &&
                        (!layout.has_token_scale || input.token_scales.size() >= static_cast<std::size_t>(num_rows)),
                    "pre-quantized input too short for ", num_rows, " rows");
  std::vector<uint8_t> wire(at(num_rows, static_cast<int64_t>(layout.row_bytes)), 0);
  for (int r = 0; r < num_rows; ++r)
    join_wire_row(layout, input.payload.data() + at(r, static_cast<int64_t>(layout.payload_bytes)),
                  input.scales.data() + at(r, static_cast<int64_t>(scale_row)),
                  layout.has_token_scale ? &input.token_scales[static_cast<std::size_t>(r)] : nullptr,
                  wire.data() + at(r, static_cast<int64_t>(layout.row_bytes)));
  return wire;
}

void join_wire_row(WireRowLayout const& layout, uint8_t const* payload, uint8_t const* scales, float const* token_scale,
                   uint8_t* wire) {
  std::size_t const scale_row = static_cast<std::size_t>(layout.num_scales) * layout.scale_bytes;
  std::memset(wire, 0, layout.row_bytes);
  std::memcpy(wire, payload, layout.payload_bytes);
  std::memcpy(wire + layout.scales_offset, scales, scale_row);
  if (layout.has_token_scale) std::memcpy(wire + layout.token_scale_offset, token_scale, sizeof(float));
}

DeliveredRows deliver(EpConfig const& config, std::span<uint8_t const> wire, int num_rows, int tensor_rows) {
  WireFormat const format = config.dispatch_format;
  FERRY_CHECK_INPUT(format != WireFormat::bf16, "deliver needs a quantized dispatch_format");
  FERRY_CHECK_INPUT(num_rows >= 0 && num_rows <= tensor_rows, "num_rows=", num_rows,
                    " is outside [0, tensor_rows=", tensor_rows, "]");
  WireRowLayout const layout = wire_row_layout(format, config.hidden);
  FERRY_CHECK_INPUT(wire.size() >= at(num_rows, static_cast<int64_t>(layout.row_bytes)), "wire holds ", wire.size(),
                    " bytes, ", num_rows, " rows need ", at(num_rows, static_cast<int64_t>(layout.row_bytes)));
  DeliveredRows out;
  out.payload.resize(at(num_rows, static_cast<int64_t>(layout.payload_bytes)));
  for (int r = 0; r < num_rows; ++r)
    std::memcpy(out.payload.data() + at(r, static_cast<int64_t>(layout.payload_bytes)),
                wire.data() + at(r, static_cast<int64_t>(layout.row_bytes)), layout.payload_bytes);
  // the scale tensor of tensor_rows rows: the first num_rows from the wire, the rest zero rows
  std::vector<uint8_t> padded(at(tensor_rows, static_cast<int64_t>(layout.row_bytes)), 0);
  if (num_rows > 0) std::memcpy(padded.data(), wire.data(), at(num_rows, static_cast<int64_t>(layout.row_bytes)));
  out.scales.resize(scale_tensor_bytes(format, config.recv_scale_layout, tensor_rows, config.hidden));
  wire::write_scale_tensor(format, config.recv_scale_layout, padded.data(), layout.row_bytes, tensor_rows,
                            config.hidden, out.scales.data());
  if (layout.has_token_scale) {
    out.token_scales.resize(static_cast<std::size_t>(tensor_rows));
    wire::write_token_scales(format, padded.data(), layout.row_bytes, tensor_rows, config.hidden,
                              out.token_scales.data());
  }
  return out;
}

std::string compare_delivered_scales(EpConfig const& config, DeliveredRows const& want, void const* scales,
                                     float const* token_scales, int num_rows, int tensor_rows) {
  WireFormat const format = config.dispatch_format;
  WireRowLayout const row = wire_row_layout(format, config.hidden);
  auto const* got = static_cast<uint8_t const*>(scales);
  for (int r = 0; r < num_rows; ++r) {
    for (int j = 0; j < row.num_scales; ++j) {
      std::size_t const offset = scale_byte_offset(format, config.recv_scale_layout, tensor_rows, config.hidden, r, j);
      if (std::memcmp(got + offset, want.scales.data() + offset, static_cast<std::size_t>(row.scale_bytes)) != 0)
        return detail::concat("scale of row ", r, " block ", j, " differs");
    }
    if (row.has_token_scale &&
        std::memcmp(&token_scales[r], &want.token_scales[static_cast<std::size_t>(r)], sizeof(float)) != 0)
      return detail::concat("token scale of row ", r, " differs");
  }
  return "";
}

std::vector<uint16_t> reduce_local_experts(EpConfig const& config, int world, RankDispatch const& received,
                                           std::vector<uint16_t> const& expert_out) {
  int const hidden = config.hidden;
  int const topk = config.topk;
  std::size_t const expected =
      at(static_cast<int64_t>(config.num_local_experts(world)) * received.expert_slots, hidden);
  FERRY_CHECK_INPUT(expert_out.size() == expected, "expert_out holds ", expert_out.size(),
                    " elements; num_local_experts x expert_slots x hidden needs ", expected);
  std::vector<uint16_t> rows(at(received.num_recv, hidden));
  std::vector<float> scratch(static_cast<std::size_t>(hidden));
  for (int i = 0; i < received.num_recv; ++i)
    reduce_row(hidden, topk, received.expert_slots, received.recv_topk_idx.data() + at(i, topk),
               received.recv_slot.data() + at(i, topk), received.recv_topk_weights.data() + at(i, topk),
               expert_out.data(), scratch.data(), rows.data() + at(i, hidden));
  return rows;
}

std::vector<uint16_t> combine_expert_major(EpConfig const& config, int world, int rank,
                                           std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                           std::span<std::vector<uint16_t> const> expert_out) {
  return combine_expert_major(config, Topology{1, world}, rank, inputs, received, expert_out);
}

std::vector<uint16_t> combine_expert_major(EpConfig const& config, Topology const& topology, int rank,
                                           std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                           std::span<std::vector<uint16_t> const> expert_out) {
  int const world = topology.world();
  check_received(world, rank, inputs.size(), received.size());
  FERRY_CHECK_INPUT(expert_out.size() == static_cast<std::size_t>(world), "got ", expert_out.size(),
                    " expert outputs for world=", world);
  int const hidden = config.hidden;
  int const topk = config.topk;
  for (int d = 0; d < world; ++d) {
    RankDispatch const& rd = received[static_cast<std::size_t>(d)];
    std::size_t const expected = at(static_cast<int64_t>(config.num_local_experts(world)) * rd.expert_slots, hidden);
    FERRY_CHECK_INPUT(expert_out[static_cast<std::size_t>(d)].size() == expected, "expert_out[", d, "] holds ",
                      expert_out[static_cast<std::size_t>(d)].size(),
                      " elements; num_local_experts x expert_slots x hidden needs ", expected);
  }
  // Only the rows that came from `rank` are reduced (the receiver does this for every row; the result per row is
  // the same).
  std::vector<float> scratch(static_cast<std::size_t>(hidden));
  return source_sum(config, topology, rank, inputs, received, [&](int d, int i, uint16_t* row) -> uint16_t const* {
    RankDispatch const& rd = received[static_cast<std::size_t>(d)];
    reduce_row(hidden, topk, rd.expert_slots, rd.recv_topk_idx.data() + at(i, topk), rd.recv_slot.data() + at(i, topk),
               rd.recv_topk_weights.data() + at(i, topk), expert_out[static_cast<std::size_t>(d)].data(),
               scratch.data(), row);
    return row;
  });
}

std::vector<uint16_t> combine_rank_major(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs,
                                         std::span<RankDispatch const> received,
                                         std::span<std::vector<uint16_t> const> rows) {
  return combine_rank_major(config, Topology{1, world}, rank, inputs, received, rows);
}

std::vector<uint16_t> combine_rank_major(EpConfig const& config, Topology const& topology, int rank,
                                         std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                         std::span<std::vector<uint16_t> const> rows) {
  int const world = topology.world();
  check_received(world, rank, inputs.size(), received.size());
  FERRY_CHECK_INPUT(rows.size() == static_cast<std::size_t>(world), "got ", rows.size(), " row sets for world=", world);
  int const hidden = config.hidden;
  for (int d = 0; d < world; ++d) {
    std::size_t const expected = at(received[static_cast<std::size_t>(d)].num_recv, hidden);
    FERRY_CHECK_INPUT(rows[static_cast<std::size_t>(d)].size() == expected, "rows[", d, "] holds ",
                      rows[static_cast<std::size_t>(d)].size(), " elements; num_recv x hidden needs ", expected);
  }
  return source_sum(config, topology, rank, inputs, received, [&](int d, int i, uint16_t*) -> uint16_t const* {
    return rows[static_cast<std::size_t>(d)].data() + at(i, hidden);
  });
}

std::vector<float> dispatch_backward(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs,
                                     std::span<RankDispatch const> received,
                                     std::span<std::vector<uint16_t> const> grads, CombineLayout layout) {
  return dispatch_backward(config, Topology{1, world}, rank, inputs, received, grads, layout);
}

std::vector<float> dispatch_backward(EpConfig const& config, Topology const& topology, int rank,
                                     std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                     std::span<std::vector<uint16_t> const> grads, CombineLayout layout) {
  int const world = topology.world();
  check_received(world, rank, inputs.size(), received.size());
  FERRY_CHECK_INPUT(grads.size() == static_cast<std::size_t>(world), "got ", grads.size(),
                    " gradients for world=", world);
  int const hidden = config.hidden;
  int const topk = config.topk;
  if (layout == CombineLayout::rank_major)
    return source_sum_fp32(config, topology, rank, inputs, received, [&](int d, int i, uint16_t*) -> uint16_t const* {
      return grads[static_cast<std::size_t>(d)].data() + at(i, hidden);
    });
  std::vector<float> const ones(static_cast<std::size_t>(topk), 1.0f);
  std::vector<float> scratch(static_cast<std::size_t>(hidden));
  return source_sum_fp32(config, topology, rank, inputs, received, [&](int d, int i, uint16_t* row) -> uint16_t const* {
    RankDispatch const& rd = received[static_cast<std::size_t>(d)];
    reduce_row(hidden, topk, rd.expert_slots, rd.recv_topk_idx.data() + at(i, topk), rd.recv_slot.data() + at(i, topk),
               ones.data(), grads[static_cast<std::size_t>(d)].data(), scratch.data(), row);
    return row;
  });
}

std::vector<uint16_t> combine_backward_rows(EpConfig const& config, int world, int rank,
                                            std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                            std::span<std::vector<uint16_t> const> grad_y, CombineLayout layout) {
  check_received(world, rank, inputs.size(), received.size());
  std::vector<RankInput> const grads = gradient_inputs(config, inputs, grad_y);
  RankDispatch const moved = dispatch(config, world, rank, grads);
  if (layout == CombineLayout::rank_major) return moved.recv_x;
  std::vector<uint16_t> out = expand(config, world, moved);
  int const hidden = config.hidden;
  int const topk = config.topk;
  for (int i = 0; i < moved.num_recv; ++i)
    for (int k = 0; k < topk; ++k) {
      int32_t const e = moved.recv_topk_idx[at(i, topk) + k];
      int32_t const slot = moved.recv_slot[at(i, topk) + k];
      if (e < 0 || slot < 0) continue;
      float const w = moved.recv_topk_weights[at(i, topk) + k];
      uint16_t* const row = out.data() + at(static_cast<int64_t>(e) * moved.expert_slots + slot, hidden);
      for (int h = 0; h < hidden; ++h) row[h] = float_to_bf16(w * bf16_to_float(row[h]));
    }
  return out;
}

std::vector<float> combine_backward_weights(EpConfig const& config, int world, int rank,
                                            std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                            std::span<std::vector<uint16_t> const> grad_y,
                                            std::span<std::vector<uint16_t> const> expert_out) {
  check_received(world, rank, inputs.size(), received.size());
  FERRY_CHECK_INPUT(expert_out.size() == static_cast<std::size_t>(world), "got ", expert_out.size(),
                    " expert outputs for world=", world);
  std::vector<RankInput> const grads = gradient_inputs(config, inputs, grad_y);
  int const hidden = config.hidden;
  int const topk = config.topk;
  std::vector<float> grad_w(at(inputs[static_cast<std::size_t>(rank)].num_tokens, topk), 0.0f);
  for (int d = 0; d < world; ++d) {
    RankDispatch const moved = dispatch(config, world, d, grads);  // the gradient rows rank d received
    std::vector<uint16_t> const& out = expert_out[static_cast<std::size_t>(d)];
    FERRY_CHECK_INPUT(
        out.size() == at(static_cast<int64_t>(config.num_local_experts(world)) * moved.expert_slots, hidden),
        "expert_out[", d, "] holds ", out.size(), " elements; num_local_experts x expert_slots x hidden");
    for (int i = 0; i < moved.num_recv; ++i) {
      if (moved.recv_src[at(i, 2)] != rank) continue;
      int const t = moved.recv_src[at(i, 2) + 1];
      for (int k = 0; k < topk; ++k) {
        int32_t const e = moved.recv_topk_idx[at(i, topk) + k];
        int32_t const slot = moved.recv_slot[at(i, topk) + k];
        if (e < 0 || slot < 0) continue;
        grad_w[at(t, topk) + k] =
            dot_warp(hidden, moved.recv_x.data() + at(i, hidden),
                     out.data() + at(static_cast<int64_t>(e) * moved.expert_slots + slot, hidden));
      }
    }
  }
  return grad_w;
}

FERRY_ROW_LOOP float dot_warp(int hidden, uint16_t const* a, uint16_t const* b) {
  float lanes[32];
  int const num_vec = hidden / 8;
  for (int l = 0; l < 32; ++l) {
    float acc = 0.0f;
    for (int v = l; v < num_vec; v += 32)
      for (int j = 0; j < 8; ++j) acc = std::fmaf(bf16_to_float(a[v * 8 + j]), bf16_to_float(b[v * 8 + j]), acc);
    lanes[l] = acc;
  }
  for (int m = 16; m >= 1; m /= 2) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ m];
    std::copy(next, next + 32, lanes);
  }
  return lanes[0];
}

}  // namespace ferry::ref
