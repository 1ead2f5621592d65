#include "moerl/model/device_memory.hpp"

#ifdef MOERL_CUDA_ALLOCATOR_STATS
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace moerl::model {

int64_t peak_allocated_bytes(const c10::Device& device) {
#ifdef MOERL_CUDA_ALLOCATOR_STATS
    if (device.is_cuda()) {
        const auto stats =
            c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
        return stats.allocated_bytes[0].peak;  // [0]: all pools together
    }
#endif
    (void)device;
    return 0;
}

void reset_peak_allocated_bytes(const c10::Device& device) {
#ifdef MOERL_CUDA_ALLOCATOR_STATS
    if (device.is_cuda())
        c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : 0);
#endif
    (void)device;
}

}  // namespace moerl::model
