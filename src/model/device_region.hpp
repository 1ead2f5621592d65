// Internal: a range of device addresses whose memory can be given back to the driver and taken
// again at the same addresses (CUDA virtual memory management: an address reservation, one physical
// allocation mapped into it while held). Tensors viewing the range, and CUDA graphs that captured
// kernels reading it, stay valid across a give-back; the contents do not.
//
//   DeviceRegion r(device, bytes, "the KV cache", "lower rollout.max_batch");  // reserved, mapped, zeroed
//   r.unmap();                      // the GPU memory is free for others (training)
//   r.map();                        // taken again, zeroed
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moerl::model {

class DeviceRegion {
  public:
    // Reserves `bytes` (rounded up to the allocation granularity) on the device and maps them. `what`
    // names the contents and `advice` how to need less, for the out-of-memory error.
    DeviceRegion(int device, size_t bytes, std::string what, std::string advice);
    ~DeviceRegion();
    DeviceRegion(const DeviceRegion&) = delete;
    DeviceRegion& operator=(const DeviceRegion&) = delete;

    void* data() const { return reinterpret_cast<void*>(base_); }
    size_t size() const { return size_; }
    bool mapped() const { return mapped_; }
    // The device memory held now: size() while mapped, else 0.
    int64_t held_bytes() const { return mapped_ ? static_cast<int64_t>(size_) : 0; }

    // Gives the memory back to the driver (no kernel may still use it: the caller synchronises).
    void unmap();
    // Takes memory again and zeroes it; throws, naming the bytes needed and free, when the device
    // has too little (returns false instead when `may_fail`, changing nothing).
    bool map(bool may_fail = false);

  private:
    int device_;
    std::string what_, advice_;
    size_t size_ = 0;
    uint64_t base_ = 0;    // CUdeviceptr
    uint64_t handle_ = 0;  // CUmemGenericAllocationHandle while mapped
    bool mapped_ = false;
};

}  // namespace moerl::model
