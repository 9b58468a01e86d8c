// The traffic and the time of expert-parallel legs past one node, predicted from the routing and a link model, so
// that a cluster run has a number to be compared with (`ferry model`; docs/internode.md).
//
// Topology: N nodes x M local ranks, world rank r = node * M + local (torchrun's order). Two protocols are counted:
// - hierarchical (normal mode): a token crosses the network once per destination node other than its own, to the
//   rank of the same local index there (its rail); that rank forwards it over NVLink to the other ranks of its node
//   that hold the token's experts. Ranks of the source's own node get it over NVLink directly. Combine is the
//   reverse: each node reduces its ranks' rows of a token first, and one row per (token, remote node) crosses back.
// - direct (low-latency mode as today's single-node kernels do it): a token goes straight to each destination rank,
//   over NVLink inside the node and over the network to the others (one message per (token, remote rank)).
// Rows are de-duplicated per destination rank (or node) as the protocols do; metadata is counted per row.
// The cuda low-latency protocol across nodes (ll_dispatch_send_network: the direct route as built) is counted apart,
// with its own messages: a row per (token, remote rank holding it), a metadata record per (token, remote rank) to
// every remote rank (the receivers scan every source's records), and per (CTA, remote rank) of the grid a signal and
// (dispatch, CTA 0) the token count; its combine a row per (received row of a remote source) and the signals.
// Its forward route (ll_dispatch_send_forward) apart as well: per (token, remote node) a record of global ids and,
// when the node holds the token, its row, to the rail, which places the record on every rank of its node and the row
// on the holding ranks (NVLink); per (CTA, remote node) a signal and (CTA 0) the token count. Its combine: the node's
// holding ranks' bf16 rows to the rail (NVLink), one row per (token, remote node) back, a signal per (CTA, node).
// A row is one message in both routes: across nodes a row's chunks are in one CTA, which puts it whole.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "workloads/routing.hpp"

namespace ferry::model {

using ferry::parse_topology;
using ferry::Topology;  // ranks per node: the NVLink team

// One leg's traffic, per rank: what the slowest rank sends (max over ranks) and the mean over ranks.
struct LegTraffic {
  double network_bytes_max = 0, network_bytes_mean = 0;
  double nvlink_bytes_max = 0, nvlink_bytes_mean = 0;
  double network_messages_max = 0;  // puts over the network (one per row and destination)
  double network_rows_mean = 0;     // rows that cross the network, per rank
  double control_messages = 0;      // per rank, besides network_messages_max: signals, counts and abort words
};

struct Traffic {
  int tokens_per_rank = 0;
  LegTraffic hier_dispatch, hier_combine;      // hierarchical normal mode
  LegTraffic direct_dispatch, direct_combine;  // straight to each destination rank
  LegTraffic ll_dispatch, ll_combine;          // the cuda low-latency protocol across nodes, with its own messages
  LegTraffic ll_fwd_dispatch, ll_fwd_combine;  // the same, forward route
  // averages over every token of every rank
  double dest_ranks_per_token = 0;     // distinct destination ranks
  double remote_nodes_per_token = 0;   // distinct destination nodes other than the token's own
  double remote_ranks_per_token = 0;   // distinct destination ranks on other nodes
  std::size_t dispatch_row_bytes = 0;  // wire row + metadata
  std::size_t combine_row_bytes = 0;   // wire row of combine_format
};

// Counts the traffic of `tokens_per_rank` tokens on every rank, routed by `routing` (the generators of
// workloads/routing.hpp, as ferry bench routes). config.num_experts must divide by topology.world().
// ll_ctas: the low-latency grid of each rank (its control messages are per CTA and remote rank); normal_ctas: normal
// mode's grid (the hierarchical protocol signals per warp of it and remote node).
Traffic count_traffic(EpConfig const& config, Topology const& topology, RoutingOptions const& routing,
                      int tokens_per_rank, int ll_ctas = 132, int normal_ctas = 132);

// The links, with the values the predictions use (printed with them). Defaults: a 400G ConnectX-7 NIC per GPU
// (50 GB/s a direction), NVLink as measured on 2 x H200 (push, both ways at once: 362 GB/s a direction), and the
// fixed costs of a leg as measured at world 2 (docs/perf.md, 1 token).
struct Links {
  double nic_gbps = 50.0;          // network, per GPU and direction
  double nic_latency_us = 4.0;     // one put-with-signal across the network, issue to visible (RDMA write + flag)
  double nvlink_gbps = 362.0;      // per GPU and direction, every peer at once
  double nvlink_latency_us = 1.3;  // one-way flag latency inside the node
  double normal_fixed_us = 8.7;    // a normal-mode leg at 1 token, world 2 (dispatch 8.8, combine 8.5)
  double ll_fixed_us = 8.4;        // a low-latency leg at 1 token, world 2 (dispatch 10.0, combine 6.7)
  // Messages the NIC issues per us (millions per second), for the protocols whose message counts are modelled (the
  // cuda low-latency protocol): an assumption, not a measured figure; a cluster run should replace it.
  double nic_mmsgs = 200.0;
};

struct LegPrediction {
  double us = 0;
  double network_gbps = 0;  // network bytes of the slowest rank / us: the physical figure, at most the NIC's
  // rows received over the network by every remote rank that holds them (one per (token, remote rank), whether it
  // crossed once per node and was forwarded or not) / us: above the NIC's rate when rows are forwarded. (DeepEP's
  // published "RDMA GB/s" counts a token once per destination node: the physical figure above.)
  double logical_network_gbps = 0;
  std::string bound;  // "network", "nvlink" or "fixed cost": what sets the time
};

struct Prediction {
  LegPrediction hier_dispatch, hier_combine;
  LegPrediction direct_dispatch, direct_combine;
  LegPrediction forward_dispatch, forward_combine;  // low-latency rows once per node with an NVLink forward
  // the cuda low-latency protocol across nodes: its bytes, and its messages at Links::nic_mmsgs
  LegPrediction ll_dispatch, ll_combine;
  LegPrediction ll_fwd_dispatch, ll_fwd_combine;  // its forward route: one network put and one NVLink hop in series
};

// The symmetric memory of one rank (the bytes of the region every rank of an EpBuffer allocates), by protocol, from
// the builder the cuda buffers are laid out with (src/ep/cuda/layout.hpp), for `config` (its max_tokens_per_rank,
// max_recv_tokens, formats) on `topology`; and DeepEP V2's hint for the same shape. 0 where a protocol does not run.
struct Memory {
  std::size_t normal = 0;      // normal mode: one node's count exchange and push, or across nodes the hierarchical one
  std::size_t ll = 0;          // low-latency mode (across nodes the route config.route() picks)
  std::size_t ll_forward = 0;  // low-latency mode across nodes, forward route (0 on one node)
  std::size_t ll_direct = 0;   // ...direct route (0 on one node)
  std::size_t deepep_v2 = 0;   // DeepEP V2's ElasticBuffer.get_buffer_size_hint(num_topk=topk, use_fp8_dispatch=fp8)
};
Memory memory_per_rank(EpConfig const& config, Topology const& topology);

// DeepEP V2's ElasticBuffer.get_buffer_size_hint (deep_ep/buffers/elastic.py, csrc/elastic/buffer.hpp
// calculate_buffer_size, at deepseek-ai/DeepEP dd758ca) for `nodes` x `local` ranks on NVLink (scale-up) domains of
// `local`, allow_hybrid_mode and allow_multiple_reduction as default: the larger of its dispatch and combine layouts,
// 2 MiB-aligned. Written from its formula (a figure to compare with, never code run).
std::size_t deepep_v2_buffer_size_hint(int max_tokens_per_rank, int hidden, int topk, bool fp8_dispatch, int nodes,
                                       int local);

// Time of a leg = its fixed cost + the slower of its network and NVLink transfers (they overlap: the forward starts
// as rows arrive) + the latency of the hops it adds in series (one network put; one NVLink forward when rows are
// forwarded). A model, not a measurement: it has no congestion, no NIC message-rate limit, no skew between ranks.
Prediction predict(Traffic const& traffic, Links const& links);

}  // namespace ferry::model
