#include "core/interrupt.hpp"

#include <atomic>

#include "ferry/interrupt.hpp"

namespace ferry {
namespace {
std::atomic<InterruptCheck> g_check{nullptr};
}  // namespace

void set_interrupt_check(InterruptCheck check) {
  g_check.store(check, std::memory_order_release);
}

namespace detail {

bool interrupt_check_set() {
  return g_check.load(std::memory_order_acquire) != nullptr;
}

bool interrupt_requested() {
  InterruptCheck const check = g_check.load(std::memory_order_acquire);
  if (check == nullptr) return false;
  thread_local std::chrono::steady_clock::time_point next;
  auto const now = std::chrono::steady_clock::now();
  if (now < next) return false;
  next = now + kInterruptPoll;
  return check();
}

}  // namespace detail
}  // namespace ferry
