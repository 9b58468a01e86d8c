#include "workloads/cost_model.hpp"

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <numeric>

#include "ep/cuda/layout.hpp"
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
                      int tokens_per_rank, int ll_ctas, int normal_ctas) {
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
  std::vector<int> dests;              // a token's destination ranks, ascending, each once
  std::vector<int> per_node;           // hits of the token on each node
  int const local_ranks = topology.local;
  double const near_peers = static_cast<double>(local_ranks - 1);
  double const far_ranks = static_cast<double>(world - local_ranks);
  for (int r = 0; r < world; ++r) {
    generate_routing(routing, config.num_experts, world, r, tokens_per_rank, config.topk - routing.shared_experts, idx,
                     weights);
    int const node = topology.node_of(r);
    int const local = r % local_ranks;
    // the ll protocol's records go to every other rank whatever the routing (T of them per rank); the forward
    // route's to every other node's rail, which places them on every other rank of its node
    double const tokens_here = static_cast<double>(tokens_per_rank);
    ll_d.nvlink[r] += tokens_here * near_peers * ll_record;
    ll_d.network[r] += tokens_here * far_ranks * ll_record;
    ll_d.messages[r] += tokens_here * far_ranks;
    llf_d.nvlink[r] += tokens_here * near_peers * ll_record;
    llf_d.network[r] += tokens_here * (topology.nodes - 1) * ll_record;
    llf_d.messages[r] += tokens_here * (topology.nodes - 1);
    for (int n = 0; n < topology.nodes; ++n)
      if (n != node) llf_d.nvlink[n * local_ranks + local] += tokens_here * near_peers * ll_record;
    for (int t = 0; t < tokens_per_rank; ++t) {
      dests.clear();
      for (int k = 0; k < columns; ++k)
        if (int64_t const e = idx[static_cast<std::size_t>(t) * columns + k]; e >= 0)
          dests.push_back(static_cast<int>(e / num_local));
      std::sort(dests.begin(), dests.end());
      dests.erase(std::unique(dests.begin(), dests.end()), dests.end());
      dest_ranks += static_cast<double>(dests.size());
      for (int d : dests) {
        if (d == r) continue;  // a rank's own rows do not cross a link
        bool const same_node = topology.node_of(d) == node;
        remote_ranks += same_node ? 0 : 1;
        (same_node ? ll_d.nvlink : ll_d.network)[r] += ll_row;  // the ll protocol's row to a rank holding the token
        (same_node ? ll_c.nvlink : ll_c.network)[d] += crow;
        if (same_node) {  // the forward route's own node, and the hierarchical one's: as on one node
          llf_d.nvlink[r] += ll_row;
          llf_c.nvlink[d] += crow;
          hier_d.nvlink[r] += drow;
          hier_c.nvlink[d] += crow;
        } else {
          ll_d.messages[r] += 1;
          ll_d.network_rows[r] += 1;
          ll_c.messages[d] += 1;
          ll_c.network_rows[d] += 1;
        }
        // direct: straight to d, and back from d
        (same_node ? direct_d.nvlink : direct_d.network)[r] += drow;
        (same_node ? direct_c.nvlink : direct_c.network)[d] += crow;
        if (!same_node) {
          direct_d.messages[r] += 1;
          direct_d.network_rows[r] += 1;
          direct_c.messages[d] += 1;
          direct_c.network_rows[d] += 1;
        }
      }
      // hierarchical, remote nodes: one row to the rail (same local index), forwarded to the node's other hits
      for (std::size_t i = 0; i < dests.size();) {
        int const n = topology.node_of(dests[i]);
        int hits = 0;
        bool rail_hit = false;
        int const rail = n * local_ranks + local;
        std::size_t j = i;
        for (; j < dests.size() && topology.node_of(dests[j]) == n; ++j) {
          ++hits;
          rail_hit |= dests[j] == rail;
        }
        if (n != node) {
          int const forwards = hits - (rail_hit ? 1 : 0);
          // the cuda forward route: the row where the node holds it (its record is counted above); the rail's rows
          // to its node's other holding ranks over NVLink
          llf_d.network[r] += ll_row;
          llf_d.messages[r] += 1;
          llf_d.network_rows[r] += 1;
          llf_d.nvlink[rail] += forwards * ll_row;
          remote_nodes += 1;
          hier_d.network[r] += drow;
          hier_d.messages[r] += 1;
          hier_d.network_rows[r] += 1;
          hier_d.nvlink[rail] += forwards * drow;
          // combine, hierarchical and the cuda forward route alike: the node's other holding ranks send their bf16
          // rows to the rail, which reduces them in fp32 and sends one row back in combine_format
          for (Sent* combine : {&hier_c, &llf_c}) {
            for (std::size_t h = i; h < j; ++h)
              if (dests[h] != rail) combine->nvlink[dests[h]] += brow;
            combine->network[rail] += crow;
            combine->messages[rail] += 1;
            combine->network_rows[rail] += 1;
          }
        }
        i = j;
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
  // the hierarchical protocol as built: a count row put (with its signal) to every rank of another node, and every warp
  // of the grid signals every other node's rail (its own puts to it); combine: the abort word and the arrival to every
  // rank of another node, and again a signal per (warp, other node)
  double const grid_warps = static_cast<double>(normal_ctas) * 16;
  double const other_nodes = static_cast<double>(topology.nodes - 1);
  traffic.hier_dispatch.control_messages = far_ranks + grid_warps * other_nodes;
  traffic.hier_combine.control_messages = 2 * far_ranks + grid_warps * other_nodes;
  traffic.direct_dispatch = direct_d.summary();
  traffic.direct_combine = direct_c.summary();
  traffic.ll_dispatch = ll_d.summary();
  traffic.ll_combine = ll_c.summary();
  // per (CTA, remote rank): the arrival signal, and (dispatch, CTA 0) the token count
  double const remote = far_ranks;
  traffic.ll_dispatch.control_messages = remote * (ll_ctas + 1);
  traffic.ll_combine.control_messages = remote * ll_ctas;
  // the forward route: per (CTA, remote node) the signal, and (dispatch, CTA 0) the token count
  traffic.ll_fwd_dispatch = llf_d.summary();
  traffic.ll_fwd_combine = llf_c.summary();
  traffic.ll_fwd_dispatch.control_messages = other_nodes * (ll_ctas + 1);
  traffic.ll_fwd_combine.control_messages = other_nodes * ll_ctas;
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

Memory memory_per_rank(EpConfig const& config, Topology const& topology) {
  int const world = topology.world();
  Memory m;
  EpConfig normal = config;
  normal.mode = Mode::normal;
  normal.validate(world);
  // normal mode: the count exchange on one node (the landing zone of small batches is a choice made per buffer,
  // FERRY_NORMAL_LANDING; the push's layout is the one every batch size can take), hierarchical across nodes
  m.normal = topology.nodes > 1 ? cuda_ep::make_hier_sym_layout(normal, topology).total
                                : cuda_ep::make_sym_layout(normal, world, detail::Protocol::push).total;
  if (config.max_tokens_per_rank <= kMaxLowLatencyTokens) {
    EpConfig ll = config;
    ll.mode = Mode::low_latency;
    ll.max_recv_tokens.reset();
    ll = ll.resolved(world);
    m.ll = cuda_ep::make_sym_layout(ll, world, detail::Protocol::ll, topology.nodes).total;
    if (topology.nodes > 1) {
      ll.internode_route = InternodeRoute::forward;
      m.ll_forward = cuda_ep::make_sym_layout(ll, world, detail::Protocol::ll, topology.nodes).total;
      ll.internode_route = InternodeRoute::direct;
      m.ll_direct = cuda_ep::make_sym_layout(ll, world, detail::Protocol::ll, topology.nodes).total;
    }
  }
  m.deepep_v2 = deepep_v2_buffer_size_hint(config.max_tokens_per_rank, config.hidden, config.topk,
                                           config.dispatch_format != WireFormat::bf16, topology.nodes, topology.local);
  return m;
}

std::size_t deepep_v2_buffer_size_hint(int max_tokens_per_rank, int hidden, int topk, bool fp8_dispatch, int nodes,
                                       int local) {
  auto const align = [](int64_t value, int64_t to) { return (value + to - 1) / to * to; };
  int64_t const t = max_tokens_per_rank;
  int64_t const k = topk == 0 ? 32 : topk;
  // a token's bytes in its buffers: hidden, scale-factor packs (4 bytes, ceil(hidden / 32) of them in fp8) and
  // metadata (topk ids and weights, and in dispatch the source index and topk linked-list words), each 32-byte aligned
  int64_t const sf_bytes = fp8_dispatch ? (hidden + 31) / 32 * 4 : 0;
  int64_t const dispatch_token = align(static_cast<int64_t>(hidden) * (fp8_dispatch ? 1 : 2), 32) + align(sf_bytes, 32) +
                                 align(k * 8 + (1 + k) * 4, 32);
  int64_t const combine_token = align(static_cast<int64_t>(hidden) * 2, 32) + align(k * 8, 32);
  int64_t const ranks = static_cast<int64_t>(nodes) * local;
  int64_t const channels = 8 * 160;  // kNumMaxChannelsPerSM x kNumMaxSMs
  int64_t dispatch = 0;
  int64_t combine = 0;
  if (nodes == 1) {
    dispatch = ranks * t * dispatch_token;                   // receive buffer; the send buffer is 0 on NVLink
    combine = std::min<int64_t>(ranks, k) * t * combine_token;  // multiple reduction
  } else {
    dispatch = local * (nodes * t) * dispatch_token + t * dispatch_token + nodes * (t + channels) * dispatch_token;
    combine = std::min<int64_t>(local, k) * (nodes * t) * combine_token +
              std::min<int64_t>(nodes, k) * t * combine_token + nodes * (t + channels) * combine_token;
  }
  return static_cast<std::size_t>(align(std::max(dispatch, combine), int64_t{2} << 20));
}

}  // namespace ferry::model
