// Internal: dtypes between safetensors, LibTorch and config.json's names (torch_dtype).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "moerl/model/safetensors.hpp"

namespace moerl::model::detail {

at::ScalarType to_scalar_type(StDType t);
StDType to_st_dtype(at::ScalarType t);                      // Float, BFloat16 or Half; throws otherwise
at::ScalarType parse_torch_dtype(const std::string& name);  // float32 | bfloat16 | float16
std::string torch_dtype_name(at::ScalarType t);

}  // namespace moerl::model::detail
