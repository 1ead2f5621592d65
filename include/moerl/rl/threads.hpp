// CPU threads of LibTorch's kernels.
#pragma once

namespace moerl::rl {

// Sets LibTorch's intra-op threads to `threads` (run.threads).
void pin_threads(int threads);

}  // namespace moerl::rl
