// Registry in Redis hashes:
//   moerl:{run}:registry            {version, uri} of the latest publish
//   moerl:{run}:registry:versions   version -> uri, every publish (history for tools)
#include "backends.hpp"
#include "redis_client.hpp"

namespace moerl::control {

namespace {

// KEYS: latest, versions. ARGV: version, uri. Returns {1} or {0, latest version}: the compare and the
// write are one script, so two trainers racing cannot both publish the same version.
constexpr const char* kPublishScript = R"lua(
local latest = redis.call('HGET', KEYS[1], 'version')
if latest and tonumber(latest) >= tonumber(ARGV[1]) then return {0, latest} end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'uri', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {1}
)lua";

class RedisRegistry final : public Registry {
  public:
    RedisRegistry(const std::string& url, const std::string& run_id)
        : latest_(redis::run_key(run_id, "registry")),
          versions_(redis::run_key(run_id, "registry:versions")),
          client_(url, redis::Options::from_url(url)) {}

    void publish(int64_t version, const std::string& checkpoint_uri) override {
        // Lua numbers are doubles: integers are exact up to 2^53.
        MOERL_CHECK(version >= 0 && version < (int64_t{1} << 53), "publish version ", version,
                    " is out of range; expected 0 <= version < 2^53");
        auto reply = client_.eval(kPublishScript, "publish", {latest_, versions_},
                                  {std::to_string(version), checkpoint_uri});
        MOERL_CHECK(reply->type == REDIS_REPLY_ARRAY && reply->elements >= 1,
                    "redis publish script: unexpected reply");
        if (redis::as_integer(reply->element[0], "publish result") == 1) return;
        MOERL_FAIL("publish of version ", version, " (", checkpoint_uri,
                   ") rejected: the latest published version is ",
                   redis::as_string(reply->element[1], "latest version"), "; expected a larger version");
    }

    std::optional<std::pair<int64_t, std::string>> latest() override {
        auto reply = client_.command({"HMGET", latest_, "version", "uri"});
        MOERL_CHECK(reply->type == REDIS_REPLY_ARRAY && reply->elements == 2,
                    "redis HMGET registry: unexpected reply");
        if (redis::is_nil(reply->element[0])) return std::nullopt;
        return std::make_pair(static_cast<int64_t>(redis::as_integer(reply->element[0], "registry version")),
                              redis::is_nil(reply->element[1])
                                  ? std::string()
                                  : redis::as_string(reply->element[1], "registry uri"));
    }

  private:
    const std::string latest_, versions_;
    redis::Client client_;  // the one connection of this registry, guarded by its own mutex
};

}  // namespace

std::unique_ptr<Registry> make_redis_registry(const std::string& url, const std::string& run_id) {
    return std::make_unique<RedisRegistry>(url, run_id);
}

}  // namespace moerl::control
