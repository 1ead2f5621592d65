// One holder at a time of a role of a run (the trainer): a lock with a time to live, renewed by
// its live holder. A holder that stops renewing (killed) loses the lock after the time to live,
// so its successor can take it; a second live one is refused.
#pragma once

#include <memory>
#include <string>

#include "moerl/control/control.hpp"

namespace moerl::control {

class RunLock {
  public:
    virtual ~RunLock() = default;  // releases the lock
    // Throws moerl::Error naming the run and the new holder when this holder lost the lock (it
    // could not renew it within the time to live and another one took it).
    virtual void check() = 0;
    // True, once, after a renewal found the control plane without the run's marker key while
    // this holder had the lock: the server lost its data (a Redis restarted without persistence).
    virtual bool take_reset() { return false; }
};

// Takes lock `name` of `run_id` for `holder` on the control plane at `address` ("embedded":
// this process; "redis://...": Redis key moerl:{run_id}:lock:{name}, and the marker key
// moerl:{run_id}:lock:{name}:epoch, set once and never expiring, whose absence reveals a reset). While
// another holder has it, waits up to ttl + 1 s for it to expire (a killed holder's successor); then throws
// moerl::Error naming the run and the holder.
std::unique_ptr<RunLock> acquire_run_lock(const std::string& address, const std::string& run_id,
                                          const std::string& name, const std::string& holder,
                                          Millis ttl = Millis(10000));

// The output directory of a run, one process at a time: an flock(2) on DIR/.moerl.lock, a file
// holding the holder's pid. The kernel drops the lock when its holder dies, so the lock file of a
// dead process is taken over at once; while a live process holds it, throws moerl::Error naming
// the directory and the holder's pid. check() throws when the lock file was removed or now names
// another process. Creates DIR when missing.
std::unique_ptr<RunLock> lock_run_directory(const std::string& dir);

}  // namespace moerl::control
