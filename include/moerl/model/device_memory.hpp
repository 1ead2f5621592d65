// What LibTorch's CUDA caching allocator has handed out: the figure a benchmark reports as peak
// GPU memory of a phase (0 on the CPU or in a build without CUDA).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace moerl::model {

// Peak bytes allocated on `device` since the last reset (or since the process started).
int64_t peak_allocated_bytes(const c10::Device& device);
// Starts a new peak at the bytes allocated now.
void reset_peak_allocated_bytes(const c10::Device& device);

}  // namespace moerl::model
