// Internal: the generator's CUDA graphs, one per batch bucket and token source (false: the uploaded
// `tokens`, true: `greedy`, the last step's own choice fed back), captured on first use.
#pragma once

#include <ATen/cuda/CUDAGraph.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>

namespace moerl::model {

class StepGraphs {
  public:
    // Replays the graph of (bucket, fed_back). The first time, `step` runs once eagerly on a side
    // stream (this step's results; it also creates the cuBLAS state a capture needs), then is
    // captured there.
    void replay(int bucket, bool fed_back, const std::function<void()>& step);
    // Device memory the captures took for their private pools (what the captured steps allocate
    // inside them: the grouped experts' temporaries), held until the graphs go.
    int64_t pool_bytes() const { return pool_bytes_; }

  private:
    std::map<std::pair<int, bool>, std::unique_ptr<at::cuda::CUDAGraph>> graphs_;
    int64_t pool_bytes_ = 0;
};

}  // namespace moerl::model
