// The host's reading of the cuda backend's mask words (ll_mask_words.hpp).
#include "ep/ll_mask_words.hpp"

#include <algorithm>
#include <bit>

#include "ferry/error.hpp"

namespace ferry::detail {
namespace {

std::string ranks_text(uint32_t bits) {
  std::string out;
  for (uint32_t m = bits; m != 0; m &= m - 1) out += concat(out.empty() ? "" : ", ", std::countr_zero(m));
  return out;
}

}  // namespace

LlCallCounters merge_call_counters(std::span<LlCallCounters const> all) {
  LlCallCounters out{0, 0, 0};
  for (LlCallCounters const& c : all) {
    out.dispatch_seq = std::max(out.dispatch_seq, c.dispatch_seq);
    out.combine_seq = std::max(out.combine_seq, c.combine_seq);
    out.epoch = std::max(out.epoch, c.epoch);
  }
  return out;
}

MaskStatus mask_status_of(LlMaskWords const& words, int world) {
  MaskStatus status;
  status.enabled = true;
  status.self = words.self != static_cast<uint32_t>(LlMaskSelf::none);
  uint32_t const all = world >= 32 ? 0xffffffffu : (1u << world) - 1u;
  uint32_t const masked = (status.self ? words.self_view : words.masked) & all;
  for (uint32_t m = masked; m != 0; m &= m - 1) status.ranks.push_back(std::countr_zero(m));
  status.dispatch_entries = static_cast<int64_t>(words.dispatch_entries);
  status.combine_entries = static_cast<int64_t>(words.combine_entries);
  status.last_dispatch_entries = static_cast<int64_t>(words.last_dispatch_entries);
  status.last_combine_entries = static_cast<int64_t>(words.last_combine_entries);
  return status;
}

std::string self_masked_message(LlMaskWords const& words, int rank, double timeout_s) {
  std::string const call = concat(words.self_leg == static_cast<uint32_t>(LlMaskLeg::combine) ? "combine" : "dispatch",
                                  " #", words.self_call);
  std::string why;
  switch (static_cast<LlMaskSelf>(words.self)) {
    case LlMaskSelf::timeout:
      why = concat("the other ranks waited ", timeout_s, " s (FERRY_TIMEOUT_S) for it and went on without rank(s) ",
                   ranks_text(words.self_lost));
      break;
    case LlMaskSelf::ahead:
      why = concat("rank ", words.self_by, " was already past this call's agreement, without this rank");
      break;
    case LlMaskSelf::asked:
      why = concat("mask_ranks asked for rank(s) ", ranks_text(words.self_lost),
                   ", and the other ranks go on without it");
      break;
    case LlMaskSelf::none:
      FERRY_THROW(Error, "ferry", "self_masked_message: rank ", rank, " is not masked");
  }
  return format_error("ferry", __FILE__, __LINE__,
                      concat("rank ", rank, " is masked on this EpBuffer: at ", call, " ", why,
                             "; its calls are refused until every rank calls clear_mask()"));
}

}  // namespace ferry::detail
