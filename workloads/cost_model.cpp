#include "workloads/cost_model.hpp"

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <numeric>

#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"

namespace ferry::model {

namespace {

// Per-rank byte counters of one leg.
struct Sent {
  std::vector<double> network, nvlink, messages, network_rows;
  explicit Sent(int world) : network(world), nvlink(world), messages(world), network_rows(world) {}
  LegTraffic summary() const {
    auto const mean = [](std::vector<double> const& v) {
      return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    };
    LegTraffic t;
    t.network_bytes_max = *std::max_element(network.begin(), network.end());
    t.network_bytes_mean = mean(network);
    t.nvlink_bytes_max = *std::max_element(nvlink.begin(), nvlink.end());
    t.nvlink_bytes_mean = mean(nvlink);
    t.network_messages_max = *std::max_element(messages.begin(), messages.end());
    t.network_rows_mean = mean(network_rows);
    return t;
  }
};

// messages: the leg's network messages when their rate is modelled (0: bytes alone), each at 1 / nic_mmsgs us.
LegPrediction leg(double fixed_us, double network_bytes, double nvlink_bytes, double logical_bytes, double hops_us,
                  Links const& links, double messages = 0) {
  // bytes / (GB/s) = ns / 1000 -> us
  double const network_us = std::max(network_bytes / links.nic_gbps / 1e3, messages / links.nic_mmsgs);
  double const nvlink_us = nvlink_bytes / links.nvlink_gbps / 1e3;
  double const transfer = std::max(network_us, nvlink_us);
  LegPrediction p;
  p.us = fixed_us + hops_us + transfer;
  p.network_gbps = network_bytes > 0 ? network_bytes / p.us / 1e3 : 0.0;
  p.logical_network_gbps = logical_bytes > 0 ? logical_bytes / p.us / 1e3 : 0.0;
  p.bound = transfer < fixed_us + hops_us ? "fixed cost" : network_us >= nvlink_us ? "network" : "nvlink";
  return p;
}

}  // namespace

Traffic count_traffic(EpConfig const& config, Topology const& topology, RoutingOptions const& routing,
                      int tokens_per_rank, int ll_ctas) {
  int const world = topology.world();
  FERRY_CHECK_CONFIG(config.num_experts % world == 0, "num_experts=", config.num_experts,
                     " is not divisible by the world ", world, " of topology ", topology.nodes, "x", topology.local);
  FERRY_CHECK_CONFIG(tokens_per_rank >= 0, "tokens per rank ", tokens_per_rank, " is negative");
  int const num_local = config.num_experts / world;
  int const columns = routing_columns(routing, config.topk - routing.shared_experts);
  validate_routing(routing, config.num_experts, world, config.topk - routing.shared_experts);

  Traffic traffic;
  traffic.tokens_per_rank = tokens_per_rank;
  // a dispatch row carries its local expert ids and weights (int32 + fp32 per column) and its source (2 x int32)
  traffic.dispatch_row_bytes =
      wire_row_bytes(config.dispatch_format, config.hidden) + static_cast<std::size_t>(columns) * 8 + 8;
  traffic.combine_row_bytes = wire_row_bytes(config.combine_format, config.hidden);
  double const drow = static_cast<double>(traffic.dispatch_row_bytes);
  double const crow = static_cast<double>(traffic.combine_row_bytes);
  double const brow = static_cast<double>(config.hidden) * 2;  // a bf16 row

  // the cuda low-latency protocol: a row is its wire row alone, its record (local ids and weights, 16-byte
  // aligned) a message of its own to every rank
  double const ll_row = static_cast<double>(wire_row_bytes(config.dispatch_format, config.hidden));
  double const ll_record = static_cast<double>((static_cast<std::size_t>(columns) * 8 + 15) / 16 * 16);
  Sent hier_d(world), hier_c(world), direct_d(world), direct_c(world), ll_d(world), ll_c(world), llf_d(world),
      llf_c(world);
  double dest_ranks = 0, remote_nodes = 0, remote_ranks = 0;
  std::vector<int64_t> idx(static_cast<std::size_t>(tokens_per_rank) * columns);
  std::vector<float> weights(idx.size());
  std::vector<char> hit(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    generate_routing(routing, config.num_experts, world, r, tokens_per_rank, config.topk - routing.shared_experts, idx,
                     weights);
    int const node = topology.node_of(r);
    int const local = r % topology.local;
    for (int t = 0; t < tokens_per_rank; ++t) {
      std::fill(hit.begin(), hit.end(), 0);
      for (int k = 0; k < columns; ++k)
        if (int64_t const e = idx[static_cast<std::size_t>(t) * columns + k]; e >= 0) hit[e / num_local] = 1;
      for (int d = 0; d < world; ++d) {
        if (d != r) {  // the ll protocol's record goes to every rank, its row to the ranks holding the token
          bool const near = topology.node_of(d) == node;
          double const bytes = ll_record + (hit[d] ? ll_row : 0.0);
          (near ? ll_d.nvlink : ll_d.network)[r] += bytes;
          (near ? ll_c.nvlink : ll_c.network)[d] += hit[d] ? crow : 0.0;
          if (near) {  // the forward route's own node: as on one node
            llf_d.nvlink[r] += bytes;
            llf_c.nvlink[d] += hit[d] ? crow : 0.0;
          }
          if (!near) {
            ll_d.messages[r] += hit[d] ? 2 : 1;
            ll_d.network_rows[r] += hit[d] ? 1 : 0;
            ll_c.messages[d] += hit[d] ? 1 : 0;
            ll_c.network_rows[d] += hit[d] ? 1 : 0;
          }
        }
        if (!hit[d]) continue;
        dest_ranks += 1;
        if (d == r) continue;  // a rank's own rows do not cross a link
        bool const same_node = topology.node_of(d) == node;
        remote_ranks += same_node ? 0 : 1;
        // direct: straight to d, and back from d
        (same_node ? direct_d.nvlink : direct_d.network)[r] += drow;
        (same_node ? direct_c.nvlink : direct_c.network)[d] += crow;
        if (!same_node) {
          direct_d.messages[r] += 1;
          direct_d.network_rows[r] += 1;
          direct_c.messages[d] += 1;
          direct_c.network_rows[d] += 1;
        }
        // hierarchical, own node: NVLink both ways
        if (same_node) {
          hier_d.nvlink[r] += drow;
          hier_c.nvlink[d] += crow;
        }
      }
      // hierarchical, remote nodes: one row to the rail (same local index), forwarded to the node's other hits
      for (int n = 0; n < topology.nodes; ++n) {
        if (n == node) continue;
        int hits = 0;
        for (int l = 0; l < topology.local; ++l) hits += hit[n * topology.local + l];
        int const rail = n * topology.local + local;
        int const forwards = hits - hit[rail];
        // the cuda forward route: a record to the rail for every remote node, the row where the node holds it;
        // the rail's records to the node's other ranks and rows to its other holding ranks over NVLink
        llf_d.network[r] += ll_record + (hits > 0 ? ll_row : 0.0);
        llf_d.messages[r] += hits > 0 ? 2 : 1;
        llf_d.network_rows[r] += hits > 0 ? 1 : 0;
        llf_d.nvlink[rail] += (topology.local - 1) * ll_record + forwards * ll_row;
        if (hits == 0) continue;
        remote_nodes += 1;
        hier_d.network[r] += drow;
        hier_d.messages[r] += 1;
        hier_d.network_rows[r] += 1;
        hier_d.nvlink[rail] += forwards * drow;
        // combine, hierarchical and the cuda forward route alike: the node's other holding ranks send their bf16
        // rows to the rail, which reduces them in fp32 and sends one row back in combine_format
        for (Sent* combine : {&hier_c, &llf_c}) {
          for (int l = 0; l < topology.local; ++l) {
            int const d = n * topology.local + l;
            if (hit[d] && d != rail) combine->nvlink[d] += brow;
          }
          combine->network[rail] += crow;
          combine->messages[rail] += 1;
          combine->network_rows[rail] += 1;
        }
      }
    }
  }
  double const tokens = static_cast<double>(tokens_per_rank) * world;
  if (tokens > 0) {
    traffic.dest_ranks_per_token = dest_ranks / tokens;
    traffic.remote_nodes_per_token = remote_nodes / tokens;
    traffic.remote_ranks_per_token = remote_ranks / tokens;
  }
  traffic.hier_dispatch = hier_d.summary();
  traffic.hier_combine = hier_c.summary();
  traffic.direct_dispatch = direct_d.summary();
  traffic.direct_combine = direct_c.summary();
  traffic.ll_dispatch = ll_d.summary();
  traffic.ll_combine = ll_c.summary();
  // per (CTA, remote rank): the arrival signal, and (dispatch, CTA 0) the token count
  double const remote = static_cast<double>(world - topology.local);
  traffic.ll_dispatch.control_messages = remote * (ll_ctas + 1);
  traffic.ll_combine.control_messages = remote * ll_ctas;
  // the forward route: per (CTA, remote node) the signal, and (dispatch, CTA 0) the token count
  traffic.ll_fwd_dispatch = llf_d.summary();
  traffic.ll_fwd_combine = llf_c.summary();
  double const remote_nodes_count = static_cast<double>(topology.nodes - 1);
  traffic.ll_fwd_dispatch.control_messages = remote_nodes_count * (ll_ctas + 1);
  traffic.ll_fwd_combine.control_messages = remote_nodes_count * ll_ctas;
  return traffic;
}

Prediction predict(Traffic const& t, Links const& links) {
  Prediction p;
  // hierarchical: one network put in series; the NVLink forward overlaps it once rows arrive, but the last row's
  // forward follows its arrival: one NVLink hop more
  double const hier_hops = links.nic_latency_us + links.nvlink_latency_us;
  // the logical bytes of a leg: what the remote ranks receive, the direct protocol's network bytes
  double const logical_d = t.direct_dispatch.network_bytes_max;
  double const logical_c = t.direct_combine.network_bytes_max;
  LegTraffic const& hd = t.hier_dispatch;
  LegTraffic const& hc = t.hier_combine;
  LegTraffic const& dd = t.direct_dispatch;
  LegTraffic const& dc = t.direct_combine;
  p.hier_dispatch = leg(links.normal_fixed_us, hd.network_bytes_max, hd.nvlink_bytes_max, logical_d, hier_hops, links);
  p.hier_combine = leg(links.normal_fixed_us, hc.network_bytes_max, hc.nvlink_bytes_max, logical_c, hier_hops, links);
  p.direct_dispatch =
      leg(links.ll_fixed_us, dd.network_bytes_max, dd.nvlink_bytes_max, logical_d, links.nic_latency_us, links);
  p.direct_combine =
      leg(links.ll_fixed_us, dc.network_bytes_max, dc.nvlink_bytes_max, logical_c, links.nic_latency_us, links);
  p.forward_dispatch = leg(links.ll_fixed_us, hd.network_bytes_max, hd.nvlink_bytes_max, logical_d, hier_hops, links);
  p.forward_combine = leg(links.ll_fixed_us, hc.network_bytes_max, hc.nvlink_bytes_max, logical_c, hier_hops, links);
  LegTraffic const& ld = t.ll_dispatch;
  LegTraffic const& lc = t.ll_combine;
  p.ll_dispatch = leg(links.ll_fixed_us, ld.network_bytes_max + 8 * ld.control_messages, ld.nvlink_bytes_max, logical_d,
                      links.nic_latency_us, links, ld.network_messages_max + ld.control_messages);
  p.ll_combine = leg(links.ll_fixed_us, lc.network_bytes_max + 8 * lc.control_messages, lc.nvlink_bytes_max, logical_c,
                     links.nic_latency_us, links, lc.network_messages_max + lc.control_messages);
  // the forward route: the rail's NVLink hop after the network put (dispatch: the placement; combine: the node's
  // rows reach the rail before its put)
  auto const with_messages = [&](LegTraffic const& l, double logical) {
    return leg(links.ll_fixed_us, l.network_bytes_max + 8 * l.control_messages, l.nvlink_bytes_max, logical, hier_hops,
               links, l.network_messages_max + l.control_messages);
  };
  p.ll_fwd_dispatch = with_messages(t.ll_fwd_dispatch, logical_d);
  p.ll_fwd_combine = with_messages(t.ll_fwd_combine, logical_c);
  return p;
}

}  // namespace ferry::model
