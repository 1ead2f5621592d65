// TaskQueue on a Redis stream "tasks" with the consumer group "workers".
//   moerl:{run}:tasks        stream; entry = {id, attempt, payload, partial}; a lease is a pending entry
//   moerl:{run}:tasks:open   set of task ids put and not yet acknowledged (outstanding())
//   moerl:{run}:tasks:done   set of acknowledged task ids: never handed out again
// Every state change is one Lua script, so a command retried after a lost reply changes nothing twice.
// Done entries leave the stream from its head only (XTRIM MINID), never by XDEL: a deleted entry at or
// past the group's last-delivered id makes Redis report the group's lag as null until the group reads
// on, and KEDA's lagCount scaler reads the lag (a null as no task waiting) to size the rollout workers.
#include <algorithm>
#include <map>
#include <string>
#include <thread>

#include "backends.hpp"
#include "redis_client.hpp"

namespace moerl::control {

namespace {

constexpr const char* kGroup = "workers";
// A blocking read holds the connection; waits are cut into slices so heartbeat() from another thread
// gets through and expired leases are noticed while waiting.
constexpr Millis kReadSlice{100};

// KEYS: stream, open, done. ARGV: task id, attempt, payload, partial. A task id already outstanding or
// done is ignored (0), which also makes a retried put harmless.
constexpr const char* kPutScript = R"lua(
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 or redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  return 0
end
redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'attempt', ARGV[2], 'payload', ARGV[3], 'partial', ARGV[4])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
)lua";

// Shared by the scripts that end leases: drops the entries before the group's oldest lease, or every
// entry up to the last one delivered when nothing is leased. Done entries between two leases stay
// until the head passes them (no queue operation reads them: they are neither pending nor new).
constexpr const char* kTrimDone = R"lua(
local function trim_done(stream, group)
  local p = redis.call('XPENDING', stream, group)
  local keep = p[2]
  if p[1] == 0 then
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local name, last = nil, nil
      for i = 1, #g, 2 do
        if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then last = g[i + 1] end
      end
      if name == group then
        local ms, seq = string.match(last, '^(%d+)-(%d+)$')
        keep = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
      end
    end
  end
  if keep then redis.call('XTRIM', stream, 'MINID', keep) end
end
)lua";

// KEYS: stream, done. ARGV: group, consumer, min idle ms. Takes over the first lease idle for longer
// than the lease timeout; returns {entry id, fields, times delivered} or nil. Entries of tasks already
// done (or deleted) are acknowledged and skipped (and trimmed once, at the end).
const std::string kClaimScript = std::string(kTrimDone) + R"lua(
local cursor, acked = '0-0', false
repeat
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], cursor, 'COUNT', 1)
  cursor = r[1]
  for _, e in ipairs(r[2]) do
    local entry, f, task = e[1], e[2], nil
    if type(f) == 'table' then
      for i = 1, #f, 2 do if f[i] == 'id' then task = f[i + 1] end end
    end
    if task == nil or redis.call('SISMEMBER', KEYS[2], task) == 1 then
      redis.call('XACK', KEYS[1], ARGV[1], entry)
      acked = true
    else
      if acked then trim_done(KEYS[1], ARGV[1]) end
      local p = redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
      return {entry, f, p[1][4]}
    end
  end
until cursor == '0-0'
if acked then trim_done(KEYS[1], ARGV[1]) end
return false
)lua";

// KEYS: stream, open, done. ARGV: group, entry id, task id. Only a lease the stream still holds makes
// the task done: after the control plane lost its data (a Redis restarted empty), a worker's late
// ack of a lease from before must not mark done a task whose experience went with the data, or the
// trainer's re-issue would skip it and wait for that experience forever. A second ack finds nothing.
const std::string kAckScript = std::string(kTrimDone) + R"lua(
local n = redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
if type(n) ~= 'number' then n = 0 end
if n == 0 then return 0 end
trim_done(KEYS[1], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('SREM', KEYS[2], ARGV[3])
return 1
)lua";

// KEYS: stream, done. ARGV: group, entry id, worker, task id, attempt, payload, partial. Re-adds the task
// only while the lease still belongs to this worker (it may have expired and moved on).
const std::string kReleaseScript = std::string(kTrimDone) + R"lua(
if redis.call('SISMEMBER', KEYS[2], ARGV[4]) == 1 then return 0 end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XADD', KEYS[1], '*', 'id', ARGV[4], 'attempt', ARGV[5], 'payload', ARGV[6], 'partial', ARGV[7])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
trim_done(KEYS[1], ARGV[1])
return 1
)lua";

// KEYS: stream. ARGV: group, consumer. Resets the idle time of the consumer's pending entries; atomic,
// so a lease taken over by another worker in the meantime is not taken back.
constexpr const char* kHeartbeatScript = R"lua(
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 100000, ARGV[2])
for first = 1, #p, 1000 do
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for i = first, math.min(first + 999, #p) do args[#args + 1] = p[i][1] end
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
return #p
)lua";

void create_group(redis::Client& client, const std::string& stream, const char* group) {
    try {
        client.command({"XGROUP", "CREATE", stream, group, "0", "MKSTREAM"});
    } catch (const moerl::Error& e) {
        if (e.message().find("BUSYGROUP") == std::string::npos) throw;
    }
}

class RedisTaskQueue final : public TaskQueue {
  public:
    RedisTaskQueue(const std::string& url, const std::string& run_id, Millis lease_timeout)
        : stream_(redis::run_key(run_id, "tasks")),
          open_(redis::run_key(run_id, "tasks:open")),
          done_(redis::run_key(run_id, "tasks:done")),
          lease_timeout_(lease_timeout),
          client_(url, redis::Options::from_url(url),
                  [this](redis::Client& c) { create_group(c, stream_, kGroup); }) {
        MOERL_CHECK(lease_timeout.count() > 0, "task queue lease timeout is ", lease_timeout.count(),
                    " ms; expected > 0");
    }

    void put(const Task& task) override {
        MOERL_CHECK(!task.id.empty(), "task with an empty id; expected a unique id per task in the run");
        client_.eval(kPutScript, "put", {stream_, open_, done_},
                     {task.id, std::to_string(task.attempt), task.payload, task.partial});
    }

    std::optional<Lease> lease(const std::string& worker, Millis wait) override {
        MOERL_CHECK(!worker.empty(), "lease with an empty worker name; expected a unique name per worker");
        const auto deadline = std::chrono::steady_clock::now() + wait;
        if (auto own = take_own_history(worker)) return own;
        for (;;) {
            if (auto claimed = take_expired(worker)) return claimed;
            auto remaining = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
            Millis block{0};
            auto args = redis::read_group_args(kGroup, worker, 1, stream_, remaining, kReadSlice, block);
            auto reply = client_.command(args, block);
            if (!redis::is_nil(reply.get()) && reply->elements > 0) {
                // [[stream, [[entry id, fields]]]]
                const redisReply* entries = reply->element[0]->element[1];
                for (size_t i = 0; i < entries->elements; ++i) {
                    const redisReply* e = entries->element[i];
                    std::string entry = redis::as_string(e->element[0], "XREADGROUP entry id");
                    auto lease = make_lease(entry, e->element[1], worker, 1);
                    if (lease) return lease;
                }
            }
            if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
        }
    }

    void ack(const Lease& lease) override {
        client_.eval(kAckScript, "ack", {stream_, open_, done_}, {kGroup, lease.lease_id, lease.task.id});
    }

    void release(const Lease& lease, const std::string& partial) override {
        client_.eval(kReleaseScript, "release", {stream_, done_},
                     {kGroup, lease.lease_id, lease.worker, lease.task.id,
                      std::to_string(lease.task.attempt + 1), lease.task.payload, partial});
    }

    void heartbeat(const std::string& worker) override {
        client_.eval(kHeartbeatScript, "heartbeat", {stream_}, {kGroup, worker});
    }

    size_t outstanding() override {
        auto reply = client_.command({"SCARD", open_});
        return static_cast<size_t>(redis::as_integer(reply.get(), "SCARD tasks:open"));
    }

  private:
    // The leases a dead process of the same worker name still holds: this process never leased
    // them, so the first lease() calls of each name take them over at once instead of waiting out
    // the lease timeout. XREADGROUP from an id reads the consumer's own pending entries.
    std::optional<Lease> take_own_history(const std::string& worker) {
        auto [cursor, fresh] = history_cursor_.try_emplace(worker, "0");
        (void)fresh;
        while (cursor->second != ">") {
            auto reply = client_.command(
                {"XREADGROUP", "GROUP", kGroup, worker, "COUNT", "1", "STREAMS", stream_, cursor->second});
            const redisReply* entries =
                redis::is_nil(reply.get()) || reply->elements == 0 ? nullptr : reply->element[0]->element[1];
            if (entries == nullptr || entries->elements == 0) {
                cursor->second = ">";
                break;
            }
            const redisReply* e = entries->element[0];
            cursor->second = redis::as_string(e->element[0], "XREADGROUP entry id");
            if (e->element[1]->type != REDIS_REPLY_ARRAY) continue;  // deleted meanwhile
            // A retry of the dead process's attempt.
            if (auto lease = make_lease(cursor->second, e->element[1], worker, 2)) return lease;
        }
        return std::nullopt;
    }

    std::optional<Lease> take_expired(const std::string& worker) {
        for (;;) {
            auto reply = client_.eval(kClaimScript, "claim expired lease", {stream_, done_},
                                      {kGroup, worker, std::to_string(lease_timeout_.count())});
            if (redis::is_nil(reply.get())) return std::nullopt;
            MOERL_CHECK(reply->type == REDIS_REPLY_ARRAY && reply->elements == 3,
                        "redis claim script: expected {entry id, fields, times delivered}");
            std::string entry = redis::as_string(reply->element[0], "claimed entry id");
            long long delivered = redis::as_integer(reply->element[2], "claimed delivery count");
            auto lease = make_lease(entry, reply->element[1], worker, delivered);
            if (lease) return lease;
        }
    }

    // A lease from a stream entry delivered `delivered` times (1 = first hand-out of this entry); nullopt
    // (after acknowledging the entry) when the task is already done.
    std::optional<Lease> make_lease(const std::string& entry, const redisReply* fields,
                                    const std::string& worker, long long delivered) {
        Lease lease;
        lease.lease_id = entry;
        lease.worker = worker;
        lease.task.id = redis::field(fields, "id");
        auto done = client_.command({"SISMEMBER", done_, lease.task.id});
        if (lease.task.id.empty() || redis::as_integer(done.get(), "SISMEMBER tasks:done") == 1) {
            client_.eval(kAckScript, "ack", {stream_, open_, done_}, {kGroup, entry, lease.task.id});
            return std::nullopt;
        }
        std::string attempt = redis::field(fields, "attempt");
        lease.task.attempt = static_cast<int>((attempt.empty() ? 0 : std::stoll(attempt)) + delivered - 1);
        lease.task.payload = redis::field(fields, "payload");
        lease.task.partial = redis::field(fields, "partial");
        return lease;
    }

    const std::string stream_, open_, done_;
    const Millis lease_timeout_;
    // Per worker name: the last own pending entry taken over, ">" once there are no more.
    std::map<std::string, std::string> history_cursor_;
    redis::Client client_;  // the one connection of this queue, guarded by its own mutex
};

}  // namespace

std::unique_ptr<TaskQueue> make_redis_task_queue(const std::string& url, const std::string& run_id,
                                                 Millis lease_timeout) {
    return std::make_unique<RedisTaskQueue>(url, run_id, lease_timeout);
}

}  // namespace moerl::control
