// The one check macro for CUDA runtime calls, for every layer built with the CUDA toolkit (no
// LibTorch). NCCL's has its own (src/ep/cuda/nccl_engine.cpp).
#pragma once

#include <cuda_runtime.h>

#include "moerl/core/error.hpp"

// MOERL_CUDA_CHECK(cudaMalloc(...)): throws moerl::Error with the call, the CUDA error name and text.
#define MOERL_CUDA_CHECK(call)                                                                       \
    do {                                                                                             \
        const cudaError_t moerl_cuda_err_ = (call);                                                  \
        if (moerl_cuda_err_ != cudaSuccess)                                                          \
            throw ::moerl::Error(                                                                    \
                ::moerl::detail::concat(#call, " failed: ", cudaGetErrorName(moerl_cuda_err_), " (", \
                                        cudaGetErrorString(moerl_cuda_err_), ")"),                   \
                __FILE__, __LINE__);                                                                 \
    } while (0)
