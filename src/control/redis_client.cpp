#include "redis_client.hpp"

#include <openssl/evp.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <thread>

#include "digest.hpp"
#include "moerl/core/env.hpp"
#include "moerl/core/log.hpp"
#include "uri_settings.hpp"

namespace moerl::control::redis {

namespace {

int parse_int(const std::string& text, const char* what, const std::string& url) {
    int value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    MOERL_CHECK(ec == std::errc() && end == text.data() + text.size() && !text.empty(), "redis URL '", url,
                "': ", what, " '", text, "' is not a number; expected redis://[:password@]host:port[/db]");
    return value;
}

timeval to_timeval(std::chrono::milliseconds ms) {
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
    return tv;
}

std::string sha1_hex(const std::string& text) { return hex_digest(EVP_sha1(), text.data(), text.size()); }

// Errors after which the connection is unusable and a fresh one may succeed.
bool is_connection_error(int err) {
    return err == REDIS_ERR_IO || err == REDIS_ERR_EOF || err == REDIS_ERR_OTHER;
}

}  // namespace

Address parse_url(const std::string& url) {
    Address a;
    const std::string base = without_query(url);  // the query holds Options
    std::string rest;
    if (base.rfind("redis://", 0) == 0) {
        rest = base.substr(8);
    } else if (base.rfind("rediss://", 0) == 0) {
        rest = base.substr(9);
        a.tls = true;
    } else {
        MOERL_FAIL("redis URL '", url, "': expected redis://[:password@]host:port[/db] or rediss://...");
    }
    auto at = rest.rfind('@');
    if (at != std::string::npos) {
        std::string userinfo = rest.substr(0, at);
        rest = rest.substr(at + 1);
        // "user:password" (Redis 6 ACL), ":password" and "password".
        auto colon = userinfo.find(':');
        if (colon == std::string::npos) {
            a.password = userinfo;
        } else {
            a.user = userinfo.substr(0, colon);
            a.password = userinfo.substr(colon + 1);
        }
    }
    auto slash = rest.find('/');
    if (slash != std::string::npos) {
        std::string db = rest.substr(slash + 1);
        if (!db.empty()) a.db = parse_int(db, "database", url);
        rest = rest.substr(0, slash);
    }
    auto colon = rest.rfind(':');
    if (colon != std::string::npos && rest.find(']') == std::string::npos) {
        a.host = rest.substr(0, colon);
        a.port = parse_int(rest.substr(colon + 1), "port", url);
    } else {
        a.host = rest;
    }
    if (!a.host.empty() && a.host.front() == '[' && a.host.back() == ']')
        a.host = a.host.substr(1, a.host.size() - 2);
    MOERL_CHECK(!a.host.empty(), "redis URL '", url, "': no host; expected redis://host:port");
    MOERL_CHECK(a.port > 0 && a.port < 65536, "redis URL '", url, "': port ", a.port,
                " is out of range 1..65535");
    return a;
}

Options Options::from_url(const std::string& url) {
    Options o;
    for (const auto& [name, text] : query_settings(url, "redis URL")) {
        if (name == "password_file") {
            o.password_file = text;
            continue;
        }
        const std::chrono::milliseconds value(query_int(url, "redis URL", name, text));
        if (name == "retry_ms") {
            o.retry_budget = value;
        } else if (name == "backoff_ms") {
            o.backoff = value;
        } else if (name == "timeout_ms") {
            o.io_timeout = value;
        } else {
            MOERL_FAIL("redis URL '", url, "': unknown setting '", name,
                       "'; expected retry_ms, backoff_ms, timeout_ms or password_file");
        }
    }
    MOERL_CHECK(o.backoff.count() > 0 && o.io_timeout.count() > 0 && o.retry_budget.count() >= 0,
                "redis URL '", url, "': backoff_ms and timeout_ms must be > 0 and retry_ms >= 0");
    return o;
}

std::string as_string(const redisReply* r, const char* what) {
    MOERL_CHECK(r != nullptr && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS),
                "redis reply for ", what, ": expected a string, got type ", r ? r->type : -1);
    return std::string(r->str, r->len);
}

long long as_integer(const redisReply* r, const char* what) {
    MOERL_CHECK(r != nullptr, "redis reply for ", what, ": expected an integer, got nothing");
    if (r->type == REDIS_REPLY_INTEGER) return r->integer;
    MOERL_CHECK(r->type == REDIS_REPLY_STRING, "redis reply for ", what, ": expected an integer, got type ",
                r->type);
    return std::stoll(std::string(r->str, r->len));
}

bool is_nil(const redisReply* r) { return r == nullptr || r->type == REDIS_REPLY_NIL; }

std::string field(const redisReply* fields, const std::string& name) {
    if (fields == nullptr || fields->type != REDIS_REPLY_ARRAY) return "";
    for (size_t i = 0; i + 1 < fields->elements; i += 2) {
        const redisReply* k = fields->element[i];
        if (k->type == REDIS_REPLY_STRING && name.size() == k->len &&
            name.compare(0, k->len, k->str, k->len) == 0)
            return as_string(fields->element[i + 1], name.c_str());
    }
    return "";
}

std::string run_key(const std::string& run_id, const std::string& name) {
    MOERL_CHECK(!run_id.empty(),
                "run id is empty; expected a name for the run (keys are moerl:{run_id}:...)");
    return "moerl:{" + run_id + "}:" + name;
}

namespace {

std::string masked(const std::string& url, const Address& a) {
    if (a.password.empty()) return url;
    const auto at = url.rfind('@', url.find('?'));
    const auto scheme = url.find("://") + 3;
    return url.substr(0, scheme) + (a.user.empty() ? "" : a.user) + ":***" + url.substr(at);
}

std::string password_for(const Address& a, const Options& o, const std::string& url) {
    if (!a.password.empty()) return a.password;
    if (!o.password_file.empty()) {
        std::ifstream in(o.password_file);
        MOERL_CHECK(in, "redis URL '", url, "': cannot read password_file ", o.password_file);
        std::string password;
        std::getline(in, password);
        MOERL_CHECK(!password.empty(), "redis URL '", url, "': password_file ", o.password_file, " is empty");
        return password;
    }
    return env::get_string("REDISCLI_AUTH", "");
}

}  // namespace

Client::Client(const std::string& url, Options options, std::function<void(Client&)> on_connect)
    : address_(parse_url(url)), options_(options), on_connect_(std::move(on_connect)) {
    url_ = masked(url, address_);
    password_ = password_for(address_, options_, url_);
    // hiredis 1.x ships TLS as a separate library (hiredis_ssl); the 0.14 one this is built against has none.
    MOERL_CHECK(!address_.tls, "redis URL '", url_,
                "': TLS (rediss://) needs hiredis >= 1.0 with hiredis_ssl, which this build does not have;"
                " expected redis://");
    std::lock_guard lock(mutex_);
    connect_locked();
}

Client::~Client() { disconnect_locked(); }

void Client::run_on_connect_locked() {
    in_on_connect_ = true;
    try {
        on_connect_(*this);
    } catch (...) {
        in_on_connect_ = false;
        throw;
    }
    in_on_connect_ = false;
}

std::vector<std::string> read_group_args(const std::string& group, const std::string& consumer, size_t count,
                                         const std::string& stream, Millis remaining, Millis slice,
                                         Millis& block) {
    std::vector<std::string> args{"XREADGROUP", "GROUP", group, consumer, "COUNT", std::to_string(count)};
    block = Millis(0);
    if (remaining.count() > 0) {
        block = std::min(remaining, slice);
        args.insert(args.end(), {"BLOCK", std::to_string(block.count())});
    }
    args.insert(args.end(), {"STREAMS", stream, ">"});
    return args;
}

uint64_t Client::generation() const {
    std::lock_guard lock(mutex_);
    return generation_;
}

void Client::disconnect_locked() {
    if (context_ != nullptr) redisFree(context_);
    context_ = nullptr;
}

void Client::connect_locked() {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + options_.retry_budget;
    auto backoff = options_.backoff;
    int attempts = 0;
    std::string last_error;
    for (;;) {
        ++attempts;
        disconnect_locked();
        context_ =
            redisConnectWithTimeout(address_.host.c_str(), address_.port, to_timeval(options_.io_timeout));
        if (context_ == nullptr) {
            last_error = "cannot allocate a hiredis context";
        } else if (context_->err != 0) {
            last_error = context_->errstr;
        } else {
            redisSetTimeout(context_, to_timeval(options_.io_timeout));
            try {
                if (!password_.empty()) {
                    Reply r(static_cast<redisReply*>(
                        address_.user.empty() ? redisCommand(context_, "AUTH %s", password_.c_str())
                                              : redisCommand(context_, "AUTH %s %s", address_.user.c_str(),
                                                             password_.c_str())));
                    if (r == nullptr) throw std::runtime_error(context_->errstr);
                    MOERL_REDIS_CHECK(r.get(), "AUTH");
                }
                if (address_.db != 0) {
                    Reply r(static_cast<redisReply*>(redisCommand(context_, "SELECT %d", address_.db)));
                    if (r == nullptr) throw std::runtime_error(context_->errstr);
                    MOERL_REDIS_CHECK(r.get(), "SELECT " + std::to_string(address_.db));
                }
                ++generation_;
                if (attempts > 1)
                    log_line("redis " + url_ + " reachable again after " + std::to_string(attempts) +
                             " connection attempts");
                if (on_connect_ && !in_on_connect_) run_on_connect_locked();
                return;
            } catch (const moerl::Error&) {
                disconnect_locked();
                throw;  // wrong password, bad database: retrying does not help
            } catch (const std::exception& e) {
                last_error = e.what();
            }
        }
        disconnect_locked();
        if (attempts == 1)
            log_line("redis " + url_ + " unreachable (" + last_error + "); retrying for up to " +
                     std::to_string(options_.retry_budget.count()) + " ms (retry_ms)");
        auto now = Clock::now();
        MOERL_CHECK(now < deadline, "redis server ", address_.host, ":", address_.port, " (", url_,
                    ") is unreachable: ", last_error, " after ", attempts, " connection attempts in ",
                    options_.retry_budget.count(), " ms (retry_ms); expected a running Redis 7");
        std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
        backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
    }
}

Reply Client::command(const std::vector<std::string>& args, std::chrono::milliseconds extra_timeout) {
    MOERL_CHECK(!args.empty(), "redis command with no arguments");
    std::lock_guard lock(mutex_);
    return command_locked(args, extra_timeout, args[0]);
}

Reply Client::command_locked(const std::vector<std::string>& args, std::chrono::milliseconds extra_timeout,
                             const std::string& what) {
    std::vector<const char*> argv;
    std::vector<size_t> argvlen;
    for (const auto& a : args) {
        argv.push_back(a.data());
        argvlen.push_back(a.size());
    }
    bool regrouped = false;
    int lost = 0;
    for (int round = 0;; ++round) {
        if (context_ == nullptr) connect_locked();
        redisSetTimeout(context_, to_timeval(options_.io_timeout + extra_timeout));
        Reply reply(static_cast<redisReply*>(
            redisCommandArgv(context_, static_cast<int>(argv.size()), argv.data(), argvlen.data())));
        if (reply == nullptr) {
            // The connection is gone (server restart, network): reconnect within the budget and retry.
            // A command whose reply was lost may have run; every caller's command is idempotent or
            // tolerates that (see the backends).
            std::string error = context_->errstr;
            MOERL_CHECK(is_connection_error(context_->err), "redis ", what, " failed: ", error);
            disconnect_locked();
            MOERL_CHECK(++lost <= 3, "redis ", what, " failed ", lost, " times on fresh connections to ",
                        url_, ": ", error, "; expected a reply within ",
                        (options_.io_timeout + extra_timeout).count(), " ms");
            continue;
        }
        if (reply->type == REDIS_REPLY_ERROR && !regrouped && on_connect_ && !in_on_connect_ &&
            (std::string(reply->str, reply->len).rfind("NOGROUP", 0) == 0 ||
             std::string(reply->str, reply->len).rfind("UNBLOCKED", 0) == 0)) {
            // The server lost its data (restart without persistence, FLUSHALL; a blocked read is
            // UNBLOCKED when its stream goes): recreate the groups once.
            regrouped = true;
            run_on_connect_locked();
            continue;
        }
        if (reply->type == REDIS_REPLY_ERROR && round < 50 &&
            std::string(reply->str, reply->len).rfind("LOADING", 0) == 0) {
            std::this_thread::sleep_for(options_.backoff);
            continue;
        }
        MOERL_REDIS_CHECK(reply.get(), what);
        return reply;
    }
}

Reply Client::eval(const std::string& script, const std::string& name, const std::vector<std::string>& keys,
                   const std::vector<std::string>& args) {
    std::vector<std::string> argv{"EVALSHA", sha1_hex(script), std::to_string(keys.size())};
    argv.insert(argv.end(), keys.begin(), keys.end());
    argv.insert(argv.end(), args.begin(), args.end());
    std::lock_guard lock(mutex_);
    try {
        return command_locked(argv, std::chrono::milliseconds(0), "script " + name);
    } catch (const moerl::Error& e) {
        if (e.message().find("NOSCRIPT") == std::string::npos) throw;
    }
    argv[0] = "EVAL";
    argv[1] = script;
    return command_locked(argv, std::chrono::milliseconds(0), "script " + name);
}

}  // namespace moerl::control::redis
