// ExperienceBuffer on a Redis stream "experience" with the consumer group "trainers".
//   moerl:{run}:experience        stream; entry = {task_id, attempt, version, payload}
//   moerl:{run}:experience:seen   set of task ids ever pushed (exactly once per task id)
// An acknowledged entry is deleted from the stream, so the stream's length is size().
#include <algorithm>
#include <map>
#include <mutex>

#include "backends.hpp"
#include "redis_client.hpp"

namespace moerl::control {

namespace {

constexpr const char* kGroup = "trainers";
constexpr Millis kReadSlice{100};

// KEYS: stream, seen. ARGV: task id, attempt, policy version, payload. 0 for a duplicate task id.
constexpr const char* kPushScript = R"lua(
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', 'task_id', ARGV[1], 'attempt', ARGV[2], 'version', ARGV[3], 'payload', ARGV[4])
return 1
)lua";

// KEYS: stream. ARGV: group, entry ids...
constexpr const char* kAckScript = R"lua(
local n = 0
for i = 2, #ARGV, 500 do
  local ids = {}
  for j = i, math.min(i + 499, #ARGV) do ids[#ids + 1] = ARGV[j] end
  n = n + redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
end
return n
)lua";

class RedisExperienceBuffer final : public ExperienceBuffer {
  public:
    RedisExperienceBuffer(const std::string& url, const std::string& run_id)
        : stream_(redis::run_key(run_id, "experience")),
          seen_(redis::run_key(run_id, "experience:seen")),
          client_(url, redis::Options::from_url(url), [this](redis::Client& c) {
              try {
                  c.command({"XGROUP", "CREATE", stream_, kGroup, "0", "MKSTREAM"});
              } catch (const moerl::Error& e) {
                  if (e.message().find("BUSYGROUP") == std::string::npos) throw;
              }
          }) {}

    bool push(const Experience& e) override {
        MOERL_CHECK(!e.task_id.empty(), "experience with an empty task id; expected the id of its task");
        // A push retried after a lost reply reports false although the first one stored it: the
        // experience is in the buffer exactly once either way.
        auto reply =
            client_.eval(kPushScript, "push", {stream_, seen_},
                         {e.task_id, std::to_string(e.attempt), std::to_string(e.policy_version), e.payload});
        return redis::as_integer(reply.get(), "push script") == 1;
    }

    std::vector<Delivery> take(const std::string& consumer, size_t max, Millis wait) override {
        MOERL_CHECK(!consumer.empty(), "take with an empty consumer name; expected the trainer's name");
        std::vector<Delivery> out;
        if (max == 0) return out;
        std::lock_guard lock(mutex_);
        // What this consumer name got before (in an earlier process, or before a reconnect that may have
        // lost a reply) and never acknowledged comes first: XREADGROUP from an id reads its pending entries.
        uint64_t generation = client_.generation();
        if (generation != generation_) {
            generation_ = generation;
            history_cursor_.clear();
        }
        auto [cursor, fresh] = history_cursor_.try_emplace(consumer, "0");
        (void)fresh;
        if (cursor->second != ">") {
            auto reply = client_.command({"XREADGROUP", "GROUP", kGroup, consumer, "COUNT",
                                          std::to_string(max), "STREAMS", stream_, cursor->second});
            std::string last = collect(reply.get(), out);
            if (last.empty()) {
                cursor->second = ">";
            } else {
                cursor->second = last;
                return out;
            }
        }
        const auto deadline = std::chrono::steady_clock::now() + wait;
        for (;;) {
            auto remaining = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
            Millis block{0};
            auto args = redis::read_group_args(kGroup, consumer, max - out.size(), stream_, remaining,
                                               kReadSlice, block);
            auto reply = client_.command(args, block);
            collect(reply.get(), out);
            if (!out.empty() || std::chrono::steady_clock::now() >= deadline) return out;
        }
    }

    void ack(const std::vector<std::string>& delivery_ids) override {
        if (delivery_ids.empty()) return;
        std::vector<std::string> args{kGroup};
        args.insert(args.end(), delivery_ids.begin(), delivery_ids.end());
        client_.eval(kAckScript, "ack", {stream_}, args);
    }

    size_t size() override {
        auto reply = client_.command({"XLEN", stream_});
        return static_cast<size_t>(redis::as_integer(reply.get(), "XLEN experience"));
    }

  private:
    // Appends the entries of an XREADGROUP reply; returns the last entry id ("" when none). Entries
    // deleted while pending (no fields) are acknowledged and skipped.
    std::string collect(const redisReply* reply, std::vector<Delivery>& out) {
        if (redis::is_nil(reply) || reply->elements == 0) return "";
        const redisReply* entries = reply->element[0]->element[1];
        std::string last;
        std::vector<std::string> gone;
        for (size_t i = 0; i < entries->elements; ++i) {
            const redisReply* e = entries->element[i];
            last = redis::as_string(e->element[0], "XREADGROUP entry id");
            const redisReply* fields = e->element[1];
            if (redis::is_nil(fields)) {
                gone.push_back(last);
                continue;
            }
            Delivery d;
            d.delivery_id = last;
            d.experience.task_id = redis::field(fields, "task_id");
            std::string attempt = redis::field(fields, "attempt");
            std::string version = redis::field(fields, "version");
            d.experience.attempt = attempt.empty() ? 0 : std::stoi(attempt);
            d.experience.policy_version = version.empty() ? 0 : std::stoll(version);
            d.experience.payload = redis::field(fields, "payload");
            out.push_back(std::move(d));
        }
        if (!gone.empty()) ack(gone);
        return last;
    }

    const std::string stream_, seen_;
    redis::Client client_;  // the one connection of this buffer, guarded by its own mutex
    std::mutex mutex_;      // guards history_cursor_, generation_ (and orders take() calls)
    // Per consumer: the id after which its pending entries are still to be re-read, or ">" when done.
    std::map<std::string, std::string> history_cursor_;  // GUARDED_BY(mutex_)
    uint64_t generation_ = 0;                            // GUARDED_BY(mutex_)
};

}  // namespace

std::unique_ptr<ExperienceBuffer> make_redis_experience_buffer(const std::string& url,
                                                               const std::string& run_id) {
    return std::make_unique<RedisExperienceBuffer>(url, run_id);
}

}  // namespace moerl::control
