// Internal: where a RunLock lives (run_lock.cpp: this process; redis_run_lock.cpp: Redis).
#pragma once

#include <memory>
#include <string>

#include "moerl/control/control.hpp"

namespace moerl::control {

class LockBackend {
  public:
    virtual ~LockBackend() = default;
    // Takes the lock for `holder` (for `ttl`) when nobody has it, renews it when `holder` has it.
    // Returns who has it afterwards. `reset` becomes true when the control plane had lost the
    // run's marker (its data) before this call.
    virtual std::string take_or_renew(const std::string& holder, Millis ttl, bool& reset) = 0;
    // Gives the lock up if `holder` still has it.
    virtual void release(const std::string& holder) = 0;
};

#ifdef MOERL_HAVE_REDIS
std::unique_ptr<LockBackend> make_redis_lock_backend(const std::string& url, const std::string& run_id,
                                                     const std::string& name);
#endif

}  // namespace moerl::control
