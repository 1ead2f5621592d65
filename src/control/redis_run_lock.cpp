// The run lock as a Redis key moerl:{run}:lock:{name} = holder, with a time to live (PX).
#include "redis_client.hpp"
#include "run_lock_backend.hpp"

namespace moerl::control {

namespace {

// KEYS: the lock. ARGV: holder, ttl ms. Takes or renews in one step; returns the holder after.
constexpr const char* kTakeScript = R"lua(
local h = redis.call('GET', KEYS[1])
if (not h) or h == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return h
)lua";

// KEYS: the lock. ARGV: holder.
constexpr const char* kReleaseScript = R"lua(
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
)lua";

class RedisLockBackend final : public LockBackend {
  public:
    RedisLockBackend(const std::string& url, const std::string& run_id, const std::string& name)
        : key_(redis::run_key(run_id, "lock:" + name)), client_(url, redis::Options::from_url(url)) {}

    std::string take_or_renew(const std::string& holder, Millis ttl) override {
        auto reply = client_.eval(kTakeScript, "take lock", {key_}, {holder, std::to_string(ttl.count())});
        return redis::as_string(reply.get(), "lock holder");
    }

    void release(const std::string& holder) override {
        client_.eval(kReleaseScript, "release lock", {key_}, {holder});
    }

  private:
    const std::string key_;
    redis::Client client_;  // guarded by its own mutex: renewals come from another thread
};

}  // namespace

std::unique_ptr<LockBackend> make_redis_lock_backend(const std::string& url, const std::string& run_id,
                                                     const std::string& name) {
    return std::make_unique<RedisLockBackend>(url, run_id, name);
}

}  // namespace moerl::control
