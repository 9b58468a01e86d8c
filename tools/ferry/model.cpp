// ferry model: the traffic and the predicted time of expert-parallel legs on N nodes x M GPUs, from the routing and a
// link model whose every input is printed (workloads/cost_model.hpp, docs/internode.md). Runs on the host; nothing is
// measured. Its figures are predictions, for a cluster run to be compared with.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "build_info.hpp"
#include "commands.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "options.hpp"
#include "core/util/result_file.hpp"
#include "workloads/cost_model.hpp"
#include "workloads/routing.hpp"

namespace ferry::cli {
namespace {

Options make_options() {
  model::Links const links;
  auto const text = [](double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  return Options(
      "model", "predict the traffic and time of dispatch and combine on N nodes x M GPUs (a model: nothing is run)",
      {
          {"topology", "2x8,4x8", "NxM topologies, comma-separated (N nodes of M GPUs)"},
          {"tokens", "128,4096", "tokens per rank, comma-separated"},
          {"hidden", "7168", "elements per row"},
          {"topk", "8", "routed experts per token"},
          {"experts", "256", "global experts (divisible by every world size)"},
          {"routing", "random", "random | ring | grouped | hot"},
          {"expert-groups", "8", "grouped routing: groups of experts"},
          {"topk-groups", "4", "grouped routing: groups a token may use"},
          {"hot-fraction", "0.5", "hot routing: share of tokens sent to the hot expert"},
          {"dispatch", "bf16", "dispatch wire format (bf16 | fp8 | fp8_ue8m0 | nvfp4 | mxfp4)"},
          {"combine", "bf16", "combine wire format"},
          {"seed", "1", "routing seed"},
          {"nic-gbps", text(links.nic_gbps), "network GB/s per GPU and direction (400G ConnectX-7: 50)"},
          {"nic-latency-us", text(links.nic_latency_us), "one network put with its signal, issue to visible"},
          {"nvlink-gbps", text(links.nvlink_gbps), "NVLink GB/s per GPU and direction, all peers at once"},
          {"nvlink-latency-us", text(links.nvlink_latency_us), "one NVLink hop (flag latency)"},
          {"normal-fixed-us", text(links.normal_fixed_us), "fixed cost of a normal-mode leg"},
          {"ll-fixed-us", text(links.ll_fixed_us), "fixed cost of a low-latency leg"},
          {"nic-mmsgs", text(links.nic_mmsgs), "network messages per us (millions/s) the NIC issues: an assumption"},
          {"ll-ctas", "132", "the low-latency grid per rank (its signals are per CTA and remote rank)"},
          {"normal-ctas", "132", "normal mode's grid per rank (the hierarchical protocol signals per warp and node)"},
          {"json", "", "write the records to this file (the result-file format of docs/design.md)"},
      });
}

std::string mb(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", bytes / 1e6);
  return text;
}

}  // namespace

int model_main(int argc, char** argv) {
  Options options = make_options();
  if (!options.parse(argc, argv)) return 0;
  util::check_result_path(options.str("json"), "--json");
  EpConfig config;
  config.hidden = options.integer("hidden");
  config.topk = options.integer("topk");
  config.num_experts = options.integer("experts");
  config.dispatch_format = parse_wire_format(options.str("dispatch"));
  config.combine_format = parse_wire_format(options.str("combine"));
  RoutingOptions routing;
  routing.kind = parse_routing(options.str("routing"));
  routing.expert_groups = options.integer("expert-groups");
  routing.topk_groups = options.integer("topk-groups");
  routing.hot_fraction = options.number("hot-fraction");
  routing.seed = static_cast<uint64_t>(options.integer("seed"));
  model::Links links;
  links.nic_gbps = options.number("nic-gbps");
  links.nic_latency_us = options.number("nic-latency-us");
  links.nvlink_gbps = options.number("nvlink-gbps");
  links.nvlink_latency_us = options.number("nvlink-latency-us");
  links.normal_fixed_us = options.number("normal-fixed-us");
  links.ll_fixed_us = options.number("ll-fixed-us");
  links.nic_mmsgs = options.number("nic-mmsgs");
  int const ll_ctas = options.integer("ll-ctas");
  int const normal_ctas = options.integer("normal-ctas");
  FERRY_CHECK_CONFIG(links.nic_gbps > 0 && links.nvlink_gbps > 0, "--nic-gbps and --nvlink-gbps must be positive");
  FERRY_CHECK_CONFIG(links.nic_mmsgs > 0, "--nic-mmsgs must be positive, got ", links.nic_mmsgs);
  FERRY_CHECK_CONFIG(ll_ctas >= 1, "--ll-ctas must be at least 1, got ", ll_ctas);
  FERRY_CHECK_CONFIG(normal_ctas >= 1, "--normal-ctas must be at least 1, got ", normal_ctas);
  std::vector<model::Topology> topologies;
  std::stringstream list(options.str("topology"));
  for (std::string item; std::getline(list, item, ',');) topologies.push_back(model::parse_topology(item));
  std::vector<int> const tokens = options.int_list("tokens");
  // Every count first: a topology or token count the model refuses is an error before anything is printed.
  std::vector<model::Traffic> traffics;
  for (model::Topology const& topo : topologies)
    for (int t : tokens) traffics.push_back(model::count_traffic(config, topo, routing, t, ll_ctas, normal_ctas));

  std::printf("ferry model: predictions, not measurements (nothing runs). Inputs:\n");
  std::printf(
      "  network %.1f GB/s per GPU and direction, %.2f us a put, %.0f M messages/s (assumed); NVLink %.1f GB/s, "
      "%.2f us a hop; low-latency grid %d CTAs\n",
      links.nic_gbps, links.nic_latency_us, links.nic_mmsgs, links.nvlink_gbps, links.nvlink_latency_us, ll_ctas);
  std::printf(
      "  fixed cost of a leg: normal %.2f us, low-latency %.2f us; hidden %d, topk %d, %d experts, %s routing, "
      "dispatch %s, combine %s\n",
      links.normal_fixed_us, links.ll_fixed_us, config.hidden, config.topk, config.num_experts,
      routing_name(routing.kind), wire_format_name(config.dispatch_format), wire_format_name(config.combine_format));
  std::printf(
      "  per rank, the slowest rank: MB sent over the network / NVLink, messages over the network (rows, counts, "
      "signals: the protocols as built), predicted us, network GB/s (physical: at most the NIC's), logical network "
      "GB/s (rows every remote rank receives, once per rank / us)\n\n");
  std::printf("%-8s %6s %-11s %-9s %9s %9s %9s %9s %9s %9s  %s\n", "topology", "tokens", "protocol", "leg", "net MB",
              "nvlink MB", "net msgs", "us", "net GB/s", "logical", "bound");
  std::vector<util::ResultRecord> records;
  auto next_traffic = traffics.begin();
  for (model::Topology const& topo : topologies) {
    for (int t : tokens) {
      model::Traffic const& traffic = *next_traffic++;
      model::Prediction const p = model::predict(traffic, links);
      std::string const name = std::to_string(topo.nodes) + "x" + std::to_string(topo.local);
      struct Row {
        char const* protocol;
        char const* leg;
        model::LegTraffic const& traffic;
        model::LegPrediction const& prediction;
      };
      Row const rows[] = {
          {"hier", "dispatch", traffic.hier_dispatch, p.hier_dispatch},
          {"hier", "combine", traffic.hier_combine, p.hier_combine},
          {"ll-direct", "dispatch", traffic.direct_dispatch, p.direct_dispatch},
          {"ll-direct", "combine", traffic.direct_combine, p.direct_combine},
          {"ll-fwd", "dispatch", traffic.hier_dispatch, p.forward_dispatch},
          {"ll-fwd", "combine", traffic.hier_combine, p.forward_combine},
          {"ll-cuda", "dispatch", traffic.ll_dispatch, p.ll_dispatch},
          {"ll-cuda", "combine", traffic.ll_combine, p.ll_combine},
          {"ll-cuda-fwd", "dispatch", traffic.ll_fwd_dispatch, p.ll_fwd_dispatch},
          {"ll-cuda-fwd", "combine", traffic.ll_fwd_combine, p.ll_fwd_combine},
      };
      for (Row const& row : rows) {
        std::printf("%-8s %6d %-11s %-9s %9s %9s %9.0f %9.1f %9.1f %9.1f  %s\n", name.c_str(), t, row.protocol,
                    row.leg, mb(row.traffic.network_bytes_max).c_str(), mb(row.traffic.nvlink_bytes_max).c_str(),
                    row.traffic.network_messages_max + row.traffic.control_messages, row.prediction.us,
                    row.prediction.network_gbps, row.prediction.logical_network_gbps, row.prediction.bound.c_str());
        util::ResultRecord& rec = records.emplace_back();
        rec.add("topology", name).add("world", topo.world()).add("tokens", t).add("protocol", row.protocol);
        rec.add("leg", row.leg).add("hidden", config.hidden).add("topk", config.topk);
        rec.add("experts", config.num_experts).add("routing", routing_name(routing.kind));
        rec.add("dispatch_format", wire_format_name(config.dispatch_format));
        rec.add("combine_format", wire_format_name(config.combine_format));
        rec.add("network_bytes", row.traffic.network_bytes_max).add("nvlink_bytes", row.traffic.nvlink_bytes_max);
        rec.add("network_messages", row.traffic.network_messages_max).add("predicted_us", row.prediction.us);
        rec.add("control_messages", row.traffic.control_messages);
        rec.add("network_gbps", row.prediction.network_gbps);
        rec.add("logical_network_gbps", row.prediction.logical_network_gbps).add("bound", row.prediction.bound);
        rec.add("nic_gbps", links.nic_gbps).add("nvlink_gbps", links.nvlink_gbps);
      }
      std::printf("%-8s %6d   a token reaches %.2f ranks: %.2f remote nodes, %.2f ranks on them\n", name.c_str(), t,
                  traffic.dest_ranks_per_token, traffic.remote_nodes_per_token, traffic.remote_ranks_per_token);
    }
  }
  std::printf(
      "\nsymmetric memory of one rank, MB (the region each rank allocates: the builder the buffers use), and DeepEP "
      "V2's get_buffer_size_hint for the same shape:\n");
  std::printf("%-8s %6s %12s %12s %12s %12s %12s\n", "topology", "tokens", "normal", "ll", "ll-direct", "ll-forward",
              "deepep-v2");
  for (model::Topology const& topo : topologies) {
    for (int t : tokens) {
      EpConfig shape = config;
      shape.max_tokens_per_rank = t;
      model::Memory const m = model::memory_per_rank(shape, topo);
      std::string const name = std::to_string(topo.nodes) + "x" + std::to_string(topo.local);
      auto const cell = [](std::size_t bytes) { return bytes == 0 ? std::string("-") : mb(static_cast<double>(bytes)); };
      std::printf("%-8s %6d %12s %12s %12s %12s %12s\n", name.c_str(), t, cell(m.normal).c_str(), cell(m.ll).c_str(),
                  cell(m.ll_direct).c_str(), cell(m.ll_forward).c_str(), cell(m.deepep_v2).c_str());
      util::ResultRecord& rec = records.emplace_back();
      rec.add("topology", name).add("world", topo.world()).add("tokens", t).add("protocol", "memory");
      rec.add("hidden", config.hidden).add("topk", config.topk).add("experts", config.num_experts);
      rec.add("dispatch_format", wire_format_name(config.dispatch_format));
      rec.add("combine_format", wire_format_name(config.combine_format));
      rec.add("normal_bytes", static_cast<double>(m.normal)).add("ll_bytes", static_cast<double>(m.ll));
      rec.add("ll_direct_bytes", static_cast<double>(m.ll_direct));
      rec.add("ll_forward_bytes", static_cast<double>(m.ll_forward));
      rec.add("deepep_v2_bytes", static_cast<double>(m.deepep_v2));
    }
  }
  std::printf(
      "\nhier: normal mode, once per destination node to the same local rank, forwarded over NVLink (combine reduces "
      "per node first).\nll-direct: straight to each destination rank. ll-fwd: low-latency rows routed as "
      "hier.\nll-cuda: the cuda "
      "low-latency protocol across nodes as built (direct, a record to every rank, per-CTA signals), its messages at "
      "--nic-mmsgs.\nll-cuda-fwd: the same, forward route as built (a record and the row once per node to its rail, "
      "per-CTA signals).\n");
  if (!options.str("json").empty())
    util::write_result_file(options.str("json"), {"ferry model", git_commit(), "model (no device)", 0}, records);
  return 0;
}

}  // namespace ferry::cli
