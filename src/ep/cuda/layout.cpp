// The symmetric region's layout (layout.hpp): the protocol's areas, laid out by its folder's layout.cpp.
#include "ep/cuda/layout.hpp"

namespace ferry::cuda_ep {

using detail::Protocol;

SymLayout make_sym_layout(EpConfig const& config, int world, Protocol protocol, int nodes) {
  SymLayout layout;
  AreaPacker areas;
  if (protocol == Protocol::ll) {
    lay_out_ll(layout.ll, areas, config, world, nodes);
    if (nodes > 1) {
      layout.nodes = nodes;
      layout.local = world / nodes;
    }
  } else {
    lay_out_normal(layout.normal, areas, config, world, protocol == Protocol::landing);
  }
  layout.total = areas.total();
  return layout;
}

SymLayout make_hier_sym_layout(EpConfig const& config, Topology const& topology) {
  SymLayout layout;
  AreaPacker areas;
  lay_out_normal(layout.normal, areas, config, topology.world(), false);
  lay_out_hier(layout.hier, layout.normal, areas, config, topology);
  layout.nodes = topology.nodes;
  layout.local = topology.local;
  layout.total = areas.total();
  return layout;
}

}  // namespace ferry::cuda_ep
