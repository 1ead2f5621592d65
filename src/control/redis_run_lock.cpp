// The run lock as a Redis key moerl:{run}:lock:{name} = holder, with a time to live (PX).
#include "redis_client.hpp"
#include "run_lock_backend.hpp"

namespace moerl::control {

namespace {

// KEYS: the lock, the run's marker. ARGV: holder, ttl ms. Takes or renews in one step; returns
// {holder after, 1 when the marker had to be created (a first holder, or a server that lost its
// data)}.
constexpr const char* kTakeScript = R"lua(
local fresh = 0
if redis.call('SET', KEYS[2], '1', 'NX') then fresh = 1 end
local h = redis.call('GET', KEYS[1])
if (not h) or h == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {ARGV[1], fresh}
end
return {h, fresh}
)lua";

// KEYS: the lock. ARGV: holder.
constexpr const char* kReleaseScript = R"lua(
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
)lua";

class RedisLockBackend final : public LockBackend {
  public:
    RedisLockBackend(const std::string& url, const std::string& run_id, const std::string& name)
        : key_(redis::run_key(run_id, "lock:" + name)),
          marker_(redis::run_key(run_id, "lock:" + name + ":epoch")),
          client_(url, redis::Options::from_url(url)) {}

    std::string take_or_renew(const std::string& holder, Millis ttl, bool& reset) override {
        auto reply =
            client_.eval(kTakeScript, "take lock", {key_, marker_}, {holder, std::to_string(ttl.count())});
        MOERL_CHECK(reply->type == REDIS_REPLY_ARRAY && reply->elements == 2,
                    "redis lock script: expected {holder, fresh}");
        reset = redis::as_integer(reply->element[1], "lock marker") == 1;
        return redis::as_string(reply->element[0], "lock holder");
    }

    void release(const std::string& holder) override {
        client_.eval(kReleaseScript, "release lock", {key_}, {holder});
    }

  private:
    const std::string key_, marker_;
    redis::Client client_;  // guarded by its own mutex: renewals come from another thread
};

}  // namespace

std::unique_ptr<LockBackend> make_redis_lock_backend(const std::string& url, const std::string& run_id,
                                                     const std::string& name) {
    return std::make_unique<RedisLockBackend>(url, run_id, name);
}

}  // namespace moerl::control
