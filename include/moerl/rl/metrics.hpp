// metrics.jsonl and the reward-curve SVG of a run.
#pragma once

#include <string>
#include <vector>

namespace moerl::rl {

// Writes an SVG line chart of `values` over `steps` (and a 10-step moving average).
void write_reward_svg(const std::string& path, const std::vector<double>& steps,
                      const std::vector<double>& values, const std::string& title);

// Keeps the lines of a metrics.jsonl whose "step" is < next_step (a resumed run rewrites the rest).
void truncate_metrics(const std::string& path, long long next_step);

}  // namespace moerl::rl
