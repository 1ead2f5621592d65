// Internal: which waiting rollout requests join the engine together. The CUDA engine prefills
// identical prompts of one call once and shares their cache blocks, so the samples of a GRPO group
// (consecutive in the queue) join in the same prefill.
#pragma once

#include <cstddef>
#include <deque>

#include "moerl/rl/rollout.hpp"

namespace moerl::rl::detail {

// Requests from `from` on with the same context (prompt and resumed tokens): one group's samples.
size_t same_context_run(const std::deque<GenRequest>& q, size_t from);

// Of the first requests of q, how many join when `room` slots are free: with `share`, whole groups
// only, but a group larger than the engine (max_batch) is split, and an idle engine takes what
// fits; without, what fits.
size_t whole_groups(const std::deque<GenRequest>& q, size_t room, size_t max_batch, bool idle, bool share);

}  // namespace moerl::rl::detail
