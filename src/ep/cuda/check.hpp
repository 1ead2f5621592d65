// Internal: the CUDA check macro of the EP engines, shared with the other layers.
#pragma once

#include "moerl/core/cuda_check.hpp"
