#include "step_graphs.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

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
        const c10::DeviceIndex device = c10::cuda::current_device();
        auto reserved = [&] {
            return c10::cuda::CUDACachingAllocator::getDeviceStats(device).reserved_bytes[0].current;
        };
        const int64_t before = reserved();
        graph->capture_begin();
        step();
        graph->capture_end();
        pool_bytes_ += std::max<int64_t>(0, reserved() - before);
    }
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(caller);
    graphs_.emplace(std::make_pair(bucket, fed_back), std::move(graph));
}

}  // namespace moerl::model
