// The host's reading of the cuda backend's mask words (ll_mask_words.hpp).
#include "ep/ll_mask_words.hpp"

#include <algorithm>

#include "core/rank_set.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {

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
  RankSet const masked =
      RankSet::from_words32(status.self ? words.self_view : words.masked, kMaskWords) & RankSet::range(0, world);
  status.ranks = masked.ranks();
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
                   RankSet::from_words32(words.self_lost, kMaskWords).text());
      break;
    case LlMaskSelf::ahead:
      why = concat("rank ", words.self_by, " was already past this call's agreement, without this rank");
      break;
    case LlMaskSelf::asked:
      why = concat("mask_ranks asked for rank(s) ", RankSet::from_words32(words.self_lost, kMaskWords).text(),
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
