// Internal: time per kernel kind of eager decode steps (GeneratorOptions::profile), from CUDA events
// recorded between the kernels and summed over the steps.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moerl::model {

class StepProfiler {
  public:
    explicit StepProfiler(bool enabled) : enabled_(enabled) {}
    ~StepProfiler();
    StepProfiler(const StepProfiler&) = delete;
    StepProfiler& operator=(const StepProfiler&) = delete;

    bool enabled() const { return enabled_; }
    // Records an event on the stream: the kernels since the previous mark count as `name`.
    void mark(const char* name, cudaStream_t stream);
    // Waits for the step's last mark and adds each span to its kind's total.
    void collect();
    void clear() { total_ms_.clear(); }
    // Milliseconds per kind since the last clear().
    std::vector<std::pair<std::string, double>> totals() const {
        return {total_ms_.begin(), total_ms_.end()};
    }

  private:
    bool enabled_;
    std::vector<std::pair<const char*, cudaEvent_t>> marks_;
    std::map<std::string, double> total_ms_;
};

}  // namespace moerl::model
