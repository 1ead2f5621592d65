// What LibTorch's CUDA caching allocator has handed out: the figure a benchmark reports as peak
// GPU memory of a phase (0 on the CPU or in a build without CUDA); and host tensors put on a device
// without waiting for its queue.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace moerl::model {

// Peak bytes allocated on `device` since the last reset (or since the process started).
int64_t peak_allocated_bytes(const c10::Device& device);
// Starts a new peak at the bytes allocated now.
void reset_peak_allocated_bytes(const c10::Device& device);

// t as `type` on `device`. A host tensor bound for a GPU goes through pinned memory (LibTorch's
// caching host allocator holds the staging block until the copy has run), so the call returns
// without waiting for the work already queued on the device; a copy from pageable memory may wait.
// Anything else converts as Tensor::to does.
at::Tensor to_device_async(const at::Tensor& t, const c10::Device& device, c10::ScalarType type);

}  // namespace moerl::model
