#include "moerl/rl/threads.hpp"

#include <ATen/Parallel.h>

namespace moerl::rl {

void pin_threads(int threads) { at::set_num_threads(threads); }

}  // namespace moerl::rl
