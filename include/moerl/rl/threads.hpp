// CPU threads of LibTorch and its BLAS, set by the binary itself so that speed and results do
// not depend on OPENBLAS_NUM_THREADS / OMP_NUM_THREADS.
#pragma once

namespace moerl::rl {

// LibTorch's intra-op threads and OpenBLAS's threads to `threads` (run.threads); inter-op
// threads to 1 (the first call of the process sets them; LibTorch allows it once).
void pin_threads(int threads);
// OpenBLAS's thread count, or -1 when the BLAS behind LibTorch is not OpenBLAS.
int blas_threads();

}  // namespace moerl::rl
