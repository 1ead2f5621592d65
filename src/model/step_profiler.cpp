#include "step_profiler.hpp"

#include "moerl/core/cuda_check.hpp"

namespace moerl::model {

StepProfiler::~StepProfiler() {
    for (auto& [name, e] : marks_) cudaEventDestroy(e);  // a step that threw before collect()
}

void StepProfiler::mark(const char* name, cudaStream_t stream) {
    if (!enabled_) return;
    cudaEvent_t e;
    MOERL_CUDA_CHECK(cudaEventCreate(&e));
    marks_.push_back({name, e});
    MOERL_CUDA_CHECK(cudaEventRecord(e, stream));
}

void StepProfiler::collect() {
    if (marks_.empty()) return;
    std::vector<std::pair<const char*, cudaEvent_t>> marks;
    marks.swap(marks_);
    MOERL_CUDA_CHECK(cudaEventSynchronize(marks.back().second));
    for (size_t i = 1; i < marks.size(); ++i) {
        float ms = 0;
        MOERL_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second));
        total_ms_[marks[i].first] += ms;
    }
    for (auto& [name, e] : marks) MOERL_CUDA_CHECK(cudaEventDestroy(e));
}

}  // namespace moerl::model
