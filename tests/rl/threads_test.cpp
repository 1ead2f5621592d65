// The binary pins its BLAS and LibTorch threads itself (run.threads). Run with
// OPENBLAS_NUM_THREADS=3 (set by CMake; OpenBLAS caps it at the number of cores): pin_threads
// must override what the variable said.
#include "moerl/rl/threads.hpp"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>

using namespace moerl::rl;

TEST(PinThreads, OverridesTheEnvironment) {
    const char* env = std::getenv("OPENBLAS_NUM_THREADS");
    ASSERT_NE(env, nullptr) << "run through ctest: it sets OPENBLAS_NUM_THREADS=3";
    const int before = blas_threads();
    if (before < 0) GTEST_SKIP() << "the BLAS behind LibTorch is not OpenBLAS";
    EXPECT_GE(before, 1);
    pin_threads(1);
    EXPECT_EQ(blas_threads(), 1);
    EXPECT_EQ(at::get_num_threads(), 1);
    EXPECT_EQ(at::get_num_interop_threads(), 1);
    pin_threads(2);
    if (before >= 2) {
        EXPECT_EQ(blas_threads(), 2);
    }
    EXPECT_EQ(at::get_num_threads(), 2);
}
