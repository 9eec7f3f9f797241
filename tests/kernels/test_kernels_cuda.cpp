#include <gtest/gtest.h>
TEST(Stub, X) {}
