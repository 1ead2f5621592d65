#include "device_region.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "moerl/core/cuda_check.hpp"
#include "moerl/core/error.hpp"

namespace moerl::model {

namespace {

void check(CUresult r, const char* call) {
    if (r == CUDA_SUCCESS) return;
    const char* name = nullptr;
    const char* text = nullptr;
    cuGetErrorName(r, &name);
    cuGetErrorString(r, &text);
    MOERL_FAIL(call, " failed: ", name ? name : "?", " (", text ? text : "?", ")");
}

#define MOERL_CU_CHECK(call) check((call), #call)

CUmemAllocationProp device_memory(int device) {
    CUmemAllocationProp p = {};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
}

double gib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

}  // namespace

DeviceRegion::DeviceRegion(int device, size_t bytes, std::string what, std::string advice)
    : device_(device), what_(std::move(what)), advice_(std::move(advice)) {
    MOERL_CU_CHECK(cuInit(0));
    const CUmemAllocationProp prop = device_memory(device);
    size_t granularity = 0;
    MOERL_CU_CHECK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    size_ = (std::max<size_t>(bytes, 1) + granularity - 1) / granularity * granularity;
    CUdeviceptr base = 0;
    MOERL_CU_CHECK(cuMemAddressReserve(&base, size_, granularity, 0, 0));
    base_ = base;
    try {
        map();
    } catch (...) {
        cuMemAddressFree(base, size_);
        throw;
    }
}

DeviceRegion::~DeviceRegion() {
    if (mapped_) {
        cudaDeviceSynchronize();  // the last kernels reading the range
        unmap();
    }
    cuMemAddressFree(static_cast<CUdeviceptr>(base_), size_);
}

void DeviceRegion::unmap() {
    if (!mapped_) return;
    MOERL_CU_CHECK(cuMemUnmap(static_cast<CUdeviceptr>(base_), size_));
    MOERL_CU_CHECK(cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle_)));
    mapped_ = false;
}

bool DeviceRegion::map(bool may_fail) {
    if (mapped_) return true;
    const CUmemAllocationProp prop = device_memory(device_);
    CUmemGenericAllocationHandle handle = 0;
    const CUresult r = cuMemCreate(&handle, size_, &prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        if (may_fail) return false;
        size_t free = 0, total = 0;
        cudaMemGetInfo(&free, &total);
        MOERL_FAIL("GPU ", device_, " out of memory: ", what_, " needs ", gib(size_), " GiB, ", gib(free),
                   " GiB of ", gib(total), " are free (", advice_, ")");
    }
    MOERL_CU_CHECK(r);
    const CUdeviceptr base = static_cast<CUdeviceptr>(base_);
    try {
        MOERL_CU_CHECK(cuMemMap(base, size_, 0, handle, 0));
        CUmemAccessDesc access = {};
        access.location = prop.location;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        const CUresult a = cuMemSetAccess(base, size_, &access, 1);
        if (a != CUDA_SUCCESS) cuMemUnmap(base, size_);
        MOERL_CU_CHECK(a);
    } catch (...) {
        cuMemRelease(handle);
        throw;
    }
    handle_ = handle;
    mapped_ = true;
    MOERL_CUDA_CHECK(cudaMemset(data(), 0, size_));
    return true;
}

}  // namespace moerl::model
