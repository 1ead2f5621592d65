#include "step_graphs.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

namespace moerl::model {

void StepGraphs::replay(int bucket, bool fed_back, const std::function<void()>& step) {
    auto it = graphs_.find({bucket, fed_back});
    if (it != graphs_.end()) {
        it->second->replay();
        return;
    }
    at::cuda::CUDAStream caller = at::cuda::getCurrentCUDAStream();
    at::cuda::CUDAStream side = at::cuda::getStreamFromPool();
    at::cuda::CUDAEvent ready;
    ready.record(caller);
    ready.block(side);
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    {
        c10::cuda::CUDAStreamGuard guard(side);
        // This step's results; the capture below records the launches without running them.
        step();
        graph->capture_begin();
        step();
        graph->capture_end();
    }
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(caller);
    graphs_.emplace(std::make_pair(bucket, fed_back), std::move(graph));
}

}  // namespace moerl::model
