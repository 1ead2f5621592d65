#include "moerl/model/device_memory.hpp"

#include <ATen/ATen.h>

#ifdef MOERL_CUDA_ALLOCATOR_STATS
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace moerl::model {

#ifdef MOERL_CUDA_ALLOCATOR_STATS
namespace {

// The caching allocator sets up its per-device state on the first allocation; its statistics calls
// refuse a device it has not seen ("Invalid device argument"). One byte makes sure it has.
c10::DeviceIndex allocator_index(const c10::Device& device) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
    (void)at::empty({1}, at::TensorOptions().device(at::kCUDA, index).dtype(at::kByte));
    return index;
}

}  // namespace
#endif

int64_t peak_allocated_bytes(const c10::Device& device) {
#ifdef MOERL_CUDA_ALLOCATOR_STATS
    if (device.is_cuda()) {
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(allocator_index(device));
        return stats.allocated_bytes[0].peak;  // [0]: all pools together
    }
#endif
    (void)device;
    return 0;
}

void reset_peak_allocated_bytes(const c10::Device& device) {
#ifdef MOERL_CUDA_ALLOCATOR_STATS
    if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(allocator_index(device));
#endif
    (void)device;
}

at::Tensor to_device_async(const at::Tensor& t, const c10::Device& device, c10::ScalarType type) {
    if (!device.is_cuda() || !t.device().is_cpu()) return t.to(device, type);
    const at::Tensor host = t.to(type);
    return (host.is_pinned() ? host : host.pin_memory()).to(device, type, /*non_blocking=*/true);
}

}  // namespace moerl::model
