#include "bootstrap/bootstrap_util.hpp"

#include "ferry/error.hpp"

namespace ferry::detail {

std::string describe(BootstrapOpDesc const& desc) {
  switch (desc.op) {
    case BootstrapOp::kAllgather:
      return concat("allgather of ", desc.bytes, " bytes per rank");
    case BootstrapOp::kBroadcast:
      return concat("broadcast of ", desc.bytes, " bytes from root ", desc.root);
    case BootstrapOp::kBarrier:
      return "barrier";
  }
  return concat("unknown operation ", static_cast<uint32_t>(desc.op));
}

std::string describe_ranks(std::vector<int> const& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += concat(i ? ", " : "", ranks[i]);
  return out;
}

std::string describe_duration(std::chrono::milliseconds duration) {
  auto const ms = duration.count();
  if (ms < 1000) return concat(ms, " ms");
  if (ms % 1000 == 0) return concat(ms / 1000, " s");
  return concat(static_cast<double>(ms) / 1000.0, " s");
}

}  // namespace ferry::detail
