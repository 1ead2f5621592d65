// Internal: where a role's model lives, from its device and dtype settings.
#pragma once

#include <string>

#include "moerl/model/model.hpp"
#include "moerl/rl/config.hpp"

namespace moerl::rl {

// device: cpu | cuda (the first GPU); dtype: fp32 | bf16. `key` names the device setting in errors.
model::ModelOptions role_model_options(const RunConfig& config, const std::string& device,
                                       const std::string& dtype, const char* key);

}  // namespace moerl::rl
