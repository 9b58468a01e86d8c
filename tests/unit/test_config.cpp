#include <gtest/gtest.h>

#include "ferry/ep.hpp"
#include "ferry/error.hpp"

TEST(Config, Placeholder) {
  EXPECT_NO_THROW(ferry::EpConfig{}.validate(4));
}
