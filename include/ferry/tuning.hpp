// Launch geometry of a kernel leg, and where it came from.
#pragma once

#include <string>

namespace ferry {

struct Geometry {
  int blocks = 0;  // CTAs; 0 = choose
  int warps = 0;   // warps per CTA; 0 = choose
  bool operator==(Geometry const&) const = default;
};

}  // namespace ferry
