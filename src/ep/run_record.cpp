#include "ep/run_record.hpp"

#include <atomic>

#include "ep/ep_impl.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {

namespace {

std::atomic<bool> g_force_fallback{false};

char const* ids_name(IndexType ids) {
  return ids == IndexType::int64 ? "int64" : "int32";
}

char const* reduce_text(bool expert_major) {
  return expert_major ? "expert-major (receiver reduces its experts, fmaf k-ascending)" : "rank-major";
}

// The wire format part of a normal dispatch.
void push_dispatch_format(std::string& out, EpConfig const& config, LegRecord const& leg) {
  WireFormat const format = config.dispatch_format;
  if (format == WireFormat::bf16) {
    out += "format bf16 (rows copied)";
    return;
  }
  out +=
      concat("format ", wire_format_name(format), " (",
             leg.prequantized ? "pre-quantized input forwarded" : "quantized once per token in the push, no extra pass",
             ", ", leg.unit, "-element units), ");
  if (config.dispatch_dequantize)
    out += "delivered as bf16 (wire rows land, then the receiver dequantizes them: a local pass over the rows)";
  else if (config.recv_scale_layout == ScaleLayout::row_major)
    out += "delivered quantized: payload + row_major scales written by the senders in place (no receiver pass)";
  else
    out += concat("delivered quantized: payload in place; scales land row-major and a receiver pass writes them in ",
                  scale_layout_name(config.recv_scale_layout),
                  " (direct stores to that layout would scatter small NVLink writes)");
}

void push_combine_format(std::string& out, EpConfig const& config, LegRecord const& leg) {
  WireFormat const format = config.combine_format;
  if (format == WireFormat::bf16) {
    out += "format bf16";
    return;
  }
  out += concat(
      "format ", wire_format_name(format), " (partial rows quantized in the push, ", leg.unit,
      "-element units; the source dequantizes to fp32 and sums ranks ascending",
      format == WireFormat::nvfp4 ? "; nvfp4 produces each row twice: its token scale needs the row's amax" : "", ")");
}

// How a low-latency dispatch's rows travel.
void push_ll_dispatch_format(std::string& out, EpConfig const& config, LegRecord const& leg) {
  if (config.dispatch_format == WireFormat::bf16) {
    out += "bf16";
    return;
  }
  out += wire_format_name(config.dispatch_format);
  out += leg.prequantized ? " (pre-quantized input forwarded" : " (quantized once per token in the send loop";
  if (config.dispatch_dequantize)
    out += "; receiver dequantizes to bf16 in the copy)";
  else
    out += concat("; payload + ", scale_layout_name(config.recv_scale_layout), " scales delivered in the copy)");
}

// A low-latency leg's path: across nodes the route and the network (protocol_why: "low-latency, rows forwarded once
// per node by its rail (2x1, network: emulated ...)"), then its own node's NVLink push; one node: the push alone.
std::string ll_route_text(ExplainContext const& context) {
  if (context.protocol_why == nullptr || *context.protocol_why == '\0') return "nvlink-push ";
  return concat(context.protocol_why, "; own node: nvlink-push ");
}

// "; fast path", or what fell back.
void push_verdict(std::string& out, LegRecord const& leg, ExplainContext const& context) {
  if (leg.fallbacks == kNoFallback)
    out += "; fast path";
  else
    out += "; fallback: " + fallback_text(leg.fallbacks, context.protocol_why);
}

std::string dispatch_text(LegRecord const& leg, ExplainContext const& context) {
  EpConfig const& config = *context.config;
  if (!leg.ran) return "dispatch: not run";
  if (leg.refused) {
    switch (leg.protocol) {
      case Protocol::push:
        return "dispatch: refused on input (joined the count exchange with no tokens and the abort flag)";
      case Protocol::landing:
        return "dispatch: refused on input (joined the landing zone with no tokens and the abort flag)";
      case Protocol::ll:
        return "dispatch: refused on input (joined with no tokens and the abort flag)";
      case Protocol::hierarchical:
        return "dispatch: refused on input (joined the count exchange over the nodes with no tokens and the abort "
               "flag)";
    }
  }
  std::string out;
  if (leg.protocol == Protocol::ll) {
    out = concat(
        "dispatch: ll/", ll_route_text(context),
        leg.split ? "split (send kernel now, receive kernel in complete_dispatch)" : "one kernel (send + receive)",
        ", ", leg.ctas, " CTAs x ", context.warps, " warps (", context.cooperative ? "cooperative; " : "",
        "grid: ", leg.plan_why, "), a warp per token (a row split over several warps when the batch has fewer ",
        "tokens than the grid has warps), own rows ",
        context.own_direct && config.dispatch_format == WireFormat::bf16
            ? "copied from x into their slots by the send half (FERRY_LL_OWN_ROWS=direct)"
            : "staged in the landing zone",
        ", receive: ordered scan in every CTA, the hits (row, expert) spread evenly over the CTAs, each landed "
        "row loaded once per CTA and copied to its slots in expert_x, ids ",
        ids_name(leg.ids), ", wire ");
    push_ll_dispatch_format(out, config, leg);
  } else {
    if (leg.protocol == Protocol::hierarchical)
      out = concat("dispatch: normal/", context.protocol_why,
                   " (count rows to every rank, rows once per remote node to its rail, which forwards them over "
                   "NVLink), ");
    else if (leg.protocol == Protocol::landing)
      out = concat("dispatch: normal/nvlink-landing (rows land in per-source slots, the receiver compacts them: no ",
                   "count exchange; ", context.protocol_why, "), ");
    else
      out = concat("dispatch: normal/nvlink-push fused (layout + count exchange + push in one kernel; ",
                   context.protocol_why, "), ");
    out += concat(leg.ctas, " CTAs x ", context.warps, " warps (", leg.plan_why, "), ids ", ids_name(leg.ids), ", ");
    push_dispatch_format(out, config, leg);
    if (leg.expand) out += ", then expand (one CTA per local expert)";
  }
  push_verdict(out, leg, context);
  return out;
}

std::string combine_text(LegRecord const& leg, ExplainContext const& context) {
  EpConfig const& config = *context.config;
  if (!leg.ran) return "combine: not run";
  if (leg.refused)
    return leg.protocol == Protocol::ll
               ? "combine: refused on input (joined with no rows and the abort flag)"
               : "combine: refused on input (every tile its sources wait for flagged with the abort flag)";
  std::string out;
  if (leg.protocol == Protocol::ll) {
    WireFormat const format = config.combine_format;
    out = concat(
        "combine: ll/", ll_route_text(context),
        leg.split ? "split (send kernel now, receive kernel in complete_combine)" : "one kernel (send + receive)", ", ",
        leg.ctas, " CTAs x ", context.warps, " warps (grid: ", leg.plan_why, "), warp per (row, ",
        context.ll_chunk_elems, "-element chunk), ", reduce_text(leg.expert_major), ", wire ", wire_format_name(format),
        format == WireFormat::bf16 ? ""
        : format == WireFormat::nvfp4
            ? " (a row's chunks on warps of one CTA, which meet the row's amax, its token scale, in shared "
              "memory and quantize in registers; source dequantizes and sums in fp32)"
            : " (chunk quantized in registers; source dequantizes and sums in fp32)");
  } else if (leg.protocol == Protocol::hierarchical) {
    out = concat("combine: normal/", context.protocol_why, " (", leg.ctas, " CTAs x ", context.warps,
                 " warps: rows of the own node to the source over NVLink, bf16 rows of another node's token to this "
                 "node's rail, which sums them in fp32 and sends one row per (token, node) over the network), ",
                 reduce_text(leg.expert_major), ", ");
    push_combine_format(out, config, leg);
  } else {
    out = concat("combine: normal/nvlink-push pipelined (", leg.push_ctas, " push + ", leg.ctas - leg.push_ctas,
                 " sum CTAs x ", context.warps, " warps, ", leg.plan_why, "), ", reduce_text(leg.expert_major), ", ");
    push_combine_format(out, config, leg);
    out += "; push chosen: the receiver reduces and stores in one pass, pull would add a write + read of every row";
  }
  push_verdict(out, leg, context);
  return out;
}

}  // namespace

std::string fallback_text(uint8_t fallbacks, char const* protocol_why) {
  std::string out;
  auto add = [&](std::string const& what) { out += (out.empty() ? "" : "; ") + what; };
  if (fallbacks & kFallbackCountExchange)
    add(concat("a small batch took the count exchange, not the landing zone (", protocol_why, ")"));
  if (fallbacks & kFallbackNarrowUnits)
    add("16-element nvfp4 units (8-byte payload pieces): hidden is not a multiple of 32");
  if (fallbacks & kFallbackGridClamped)
    add("the grid ran fewer CTAs than its plan asked for (the grid's reason says why)");
  return out;
}

std::string explain_text(RunRecord const& record, ExplainContext const& context) {
  return dispatch_text(record.dispatch, context) + "\n" + combine_text(record.combine, context);
}

void force_fallback_for_test(bool on) {
  g_force_fallback.store(on, std::memory_order_relaxed);
}

bool fallback_forced_for_test() {
  return g_force_fallback.load(std::memory_order_relaxed);
}

RunRecord const* run_record_of(EpBuffer const& buffer) {
  return EpBufferAccess::impl(buffer).run_record();
}

}  // namespace ferry::detail
