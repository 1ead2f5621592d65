#include "moerl/rl/threads.hpp"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <mutex>

namespace moerl::rl {

void pin_threads(int threads) {
    at::set_num_threads(threads);
    // Inter-op threads can be set once per process, before any inter-op work: the first call wins.
    static std::once_flag interop;
    std::call_once(interop, [] {
        try {
            at::set_num_interop_threads(1);
        } catch (const std::exception&) {  // parallel work started before: LibTorch keeps its own
        }
    });
    // LibTorch's BLAS (Debian: OpenBLAS, pthread build) starts a thread per core unless
    // OPENBLAS_NUM_THREADS says otherwise; those threads then compete with LibTorch's. Looked up at
    // run time: another BLAS behind libblas.so.3 has no such call and needs none.
    using SetThreads = void (*)(int);
    if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
        set(threads);
}

int blas_threads() {
    using GetThreads = int (*)();
    auto get = reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
    return get ? get() : -1;
}

}  // namespace moerl::rl
