// Normal mode's areas of the symmetric region (normal/layout.hpp).
#include "ep/cuda/normal/layout.hpp"

#include "ep/capacity.hpp"
#include "ep/combine_tiles.hpp"
#include "ep/cuda/layout.hpp"
#include "wire/layout.hpp"

namespace ferry::cuda_ep {

void lay_out_normal(NormalLayout& layout, AreaPacker& areas, EpConfig const& config, int world, bool landing_zone) {
  std::size_t const w = static_cast<std::size_t>(world);
  // [2 parities][world][max_tokens]: the landing slots of the small-batch dispatch and of the combine's rows
  std::size_t const slots = 2 * w * static_cast<std::size_t>(config.max_tokens_per_rank);
  std::size_t const cap = static_cast<std::size_t>(config.recv_capacity(world));
  std::size_t const topk = static_cast<std::size_t>(config.topk);
  // The areas a format needs (docs/quant.md "Row layout on the wire"): a quantized delivery lands the payload in
  // recv_x and the scales row-major in recv_scales (+ the nvfp4 token scales); dispatch_dequantize lands whole wire
  // rows in recv_wire and delivers bf16 in recv_x; combine rows come back as wire rows of combine_format.
  WireRowLayout const dispatch_wire = wire_row_layout(config.dispatch_format, config.hidden);
  bool const dequantize = config.dispatch_format != WireFormat::bf16 && config.dispatch_dequantize;
  std::size_t const combine_row = wire_row_bytes(config.combine_format, config.hidden);
  layout.every_expert = detail::slot_drops_possible(config, world);
  layout.expert_words = layout.every_expert ? config.num_experts : config.num_local_experts(world);
  layout.count_words = 1 + world + layout.expert_words;
  layout.recv_x = areas.take(cap * config.recv_row_bytes());
  if (config.delivers_quantized()) {
    layout.recv_scales = areas.take(cap * static_cast<std::size_t>(dispatch_wire.num_scales) *
                                    static_cast<std::size_t>(dispatch_wire.scale_bytes));
    if (dispatch_wire.has_token_scale) layout.recv_token_scales = areas.take(cap * sizeof(float));
  }
  // (the landing zone dequantizes straight from its landing slots)
  if (dequantize && !landing_zone) layout.recv_wire = areas.take(cap * dispatch_wire.row_bytes);
  layout.recv_idx = areas.take(cap * topk * sizeof(int32_t));
  layout.recv_w = areas.take(cap * topk * sizeof(float));
  layout.recv_src = areas.take(cap * 2 * sizeof(int32_t));
  layout.counts = areas.take(2 * w * layout.count_words * sizeof(uint64_t));
  layout.data_signal = areas.take(w * sizeof(uint64_t));
  layout.combine_abort = areas.take(2 * w * sizeof(uint64_t));
  layout.tile_flags = areas.take(w * kMaxCombineTiles * sizeof(uint64_t));
  layout.landing = areas.take(slots * combine_row);
  layout.weight_grad = areas.take(2 * static_cast<std::size_t>(config.max_tokens_per_rank) * topk * sizeof(uint64_t));
  layout.weight_grad_arrivals = areas.take(w * sizeof(uint64_t));
  if (landing_zone) {
    layout.land_arrivals = areas.take(w * sizeof(uint64_t));
    layout.land_tokens = areas.take(2 * w * sizeof(uint64_t));
    layout.land_abort = areas.take(2 * w * sizeof(uint64_t));
    layout.land_meta = areas.take(slots * landing_record_bytes(config.topk));
    layout.land_rows = areas.take(slots * dispatch_wire.row_bytes);  // wire rows: bf16 rows, or quantized ones
  }
}

}  // namespace ferry::cuda_ep
