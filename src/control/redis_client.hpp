// Internal: one Redis connection (hiredis) guarded by a mutex, with reconnect and backoff.
// Every backend object owns one RedisClient; all Redis commands of moerl go through command().
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "moerl/core/error.hpp"

// Throws moerl::Error naming the command when Redis answered with an error reply.
#define MOERL_REDIS_CHECK(reply, what)                                                                 \
    MOERL_CHECK((reply) != nullptr && (reply)->type != REDIS_REPLY_ERROR, "redis ", what, " failed: ", \
                ((reply) != nullptr ? std::string((reply)->str, (reply)->len) : std::string("no reply")))

namespace moerl::control::redis {

// Where to connect; parsed from redis://[[user]:password@]host:port[/db][?settings] (see Options).
struct Address {
    std::string host = "127.0.0.1";
    int port = 6379;
    std::string user;      // Redis 6 ACL user; empty: AUTH with the password alone
    std::string password;  // empty: the Options' password_file, else REDISCLI_AUTH, else no AUTH
    int db = 0;
    bool tls = false;  // rediss://
};
Address parse_url(const std::string& url);

// How to connect: the URL's query, e.g. redis://host:6379/0?retry_ms=60000.
struct Options {
    // retry_ms: total time spent reconnecting before a command fails (default 30000, >= 0). Raise it
    // where Redis may be away longer, e.g. a pod rescheduled onto another node.
    std::chrono::milliseconds retry_budget{30000};
    // backoff_ms: first backoff between reconnect attempts, doubled up to 2 s (default 50, > 0).
    std::chrono::milliseconds backoff{50};
    // timeout_ms: connect and per-command socket timeout (default 5000, > 0); a blocking command's
    // own wait is added to it.
    std::chrono::milliseconds io_timeout{5000};
    // password_file: a file holding the password (a mounted Kubernetes Secret), so it stays out of
    // the command line; used when the URL has none. Otherwise REDISCLI_AUTH, as redis-cli reads it.
    std::string password_file;
    // Reads the settings above from the URL's query; an unknown name is an error.
    static Options from_url(const std::string& url);
};

struct ReplyDeleter {
    void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// Reply accessors; each throws moerl::Error naming what it expected.
std::string as_string(const redisReply* r, const char* what);
long long as_integer(const redisReply* r, const char* what);
bool is_nil(const redisReply* r);
// A stream entry's fields [f1, v1, f2, v2, ...] as a lookup; missing fields give "".
std::string field(const redisReply* fields, const std::string& name);

class Client {
  public:
    // on_connect runs after every (re)connect (e.g. to create consumer groups again after the server
    // lost its data); it may call command() on this client.
    Client(const std::string& url, Options options, std::function<void(Client&)> on_connect = {});
    ~Client();
    Client(const Client&) = delete;
    Client& operator=(const Client&) = delete;

    // Runs one command, reconnecting with backoff when the connection is gone. Error replies throw
    // (MOERL_REDIS_CHECK). extra_timeout covers a blocking command's own wait.
    Reply command(const std::vector<std::string>& args,
                  std::chrono::milliseconds extra_timeout = std::chrono::milliseconds(0));
    // EVALSHA with the script's sha1, loading it (EVAL) when the server does not know it.
    Reply eval(const std::string& script, const std::string& name, const std::vector<std::string>& keys,
               const std::vector<std::string>& args);

    // Times the connection was (re)established, for callers that must resynchronise after a reconnect.
    uint64_t generation() const;
    const std::string& url() const { return url_; }

  private:
    Reply command_locked(const std::vector<std::string>& args, std::chrono::milliseconds extra_timeout,
                         const std::string& what);
    void connect_locked();  // throws after the retry budget
    void run_on_connect_locked();
    void disconnect_locked();

    std::string url_;  // with the password masked, for messages
    Address address_;
    std::string password_;
    Options options_;
    std::function<void(Client&)> on_connect_;
    mutable std::recursive_mutex mutex_;  // guards context_, generation_, in_on_connect_
    redisContext* context_ = nullptr;     // GUARDED_BY(mutex_)
    uint64_t generation_ = 0;             // GUARDED_BY(mutex_)
    bool in_on_connect_ = false;          // GUARDED_BY(mutex_)
};

using Millis = std::chrono::milliseconds;

// XREADGROUP of up to `count` new entries of `stream`, blocking for min(remaining, slice) when some
// time remains (`block` gets that wait, for the client's socket timeout).
std::vector<std::string> read_group_args(const std::string& group, const std::string& consumer, size_t count,
                                         const std::string& stream, Millis remaining, Millis slice,
                                         Millis& block);

// Keys of one run: "moerl:{run_id}:name". The braces are a Redis Cluster hash tag, so every key of a
// run lands in one slot and the multi-key scripts below stay valid on a cluster.
std::string run_key(const std::string& run_id, const std::string& name);

}  // namespace moerl::control::redis
