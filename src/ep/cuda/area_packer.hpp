// Places the areas of one allocation (the symmetric region's layout, a handle's storage) one after another.
#pragma once

#include <cstddef>

#include "wire/layout.hpp"

namespace ferry::cuda_ep {

// Places areas one after another, each starting 256-byte aligned: every row and word area on its own cache lines, and
// 16-byte vectors aligned (the symmetric region's layout, make_sym_layout, and a handle's, make_handle_layout).
class AreaPacker {
 public:
  std::size_t take(std::size_t bytes) {
    std::size_t const at = offset_;
    offset_ = wire::align_up(offset_ + bytes, kAlign);
    return at;
  }
  std::size_t total() const { return offset_; }

 private:
  static constexpr std::size_t kAlign = 256;
  std::size_t offset_ = 0;
};

}  // namespace ferry::cuda_ep
