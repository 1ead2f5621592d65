// Internal: the one checking macro for libfabric return codes, and RAII handles for fid objects.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_errno.h>

#include <cstdio>
#include <memory>
#include <utility>

#include "moerl/core/error.hpp"

// MOERL_FI_CHECK(fi_enable(ep), "fi_enable"): throws moerl::Error with fi_strerror's text when the call
// returns a negative code. Calls returning a count (fi_cq_read, fi_av_insert) pass through when >= 0.
#define MOERL_FI_CHECK(call, what)                                                                           \
    do {                                                                                                     \
        const long moerl_fi_rc_ = static_cast<long>(call);                                                   \
        if (moerl_fi_rc_ < 0)                                                                                \
            throw ::moerl::Error(::moerl::detail::concat("libfabric: ", what, " failed: ",                   \
                                                         fi_strerror(static_cast<int>(-moerl_fi_rc_)), " (", \
                                                         moerl_fi_rc_, ")"),                                 \
                                 __FILE__, __LINE__);                                                        \
    } while (0)

namespace moerl::ep::fabric {

// Owns one libfabric object (fid_fabric, fid_domain, fid_cq, fid_av, fid_ep, fid_mr): fi_close on reset.
template <typename T>
class Fid {
  public:
    Fid() = default;
    Fid(const Fid&) = delete;
    Fid& operator=(const Fid&) = delete;
    Fid(Fid&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)) {}
    Fid& operator=(Fid&& o) noexcept {
        reset();
        ptr_ = std::exchange(o.ptr_, nullptr);
        return *this;
    }
    ~Fid() { reset(); }

    T* get() const { return ptr_; }
    fid* as_fid() const { return &ptr_->fid; }
    // For the out-parameter of the fi_* open calls.
    T** out() {
        reset();
        return &ptr_;
    }
    // Never throws: it runs in teardown, where a failed close can only be reported.
    void reset() noexcept {
        if (ptr_ == nullptr) return;
        const int rc = fi_close(&ptr_->fid);
        if (rc != 0)
            std::fprintf(stderr, "moerl: libfabric: fi_close failed: %s (%d)\n", fi_strerror(-rc), rc);
        ptr_ = nullptr;
    }

  private:
    T* ptr_ = nullptr;
};

struct InfoDeleter {
    void operator()(fi_info* info) const { fi_freeinfo(info); }
};
using Info = std::unique_ptr<fi_info, InfoDeleter>;

}  // namespace moerl::ep::fabric
