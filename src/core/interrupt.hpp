// The library's side of set_interrupt_check (include/ferry/interrupt.hpp): what a host wait calls.
#pragma once

#include <chrono>

namespace ferry::detail {

// How often a waiting thread calls the check.
inline constexpr std::chrono::milliseconds kInterruptPoll{100};

// Whether a check is set (a wait that would block in one call, cudaStreamSynchronize, polls instead).
bool interrupt_check_set();

// Whether the check asks this wait to end: calls it at most every kInterruptPoll on this thread (false without one).
bool interrupt_requested();

}  // namespace ferry::detail
