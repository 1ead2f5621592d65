#include "backends.hpp"
#include "moerl/core/error.hpp"

namespace moerl::control {

namespace {
[[maybe_unused]] bool is_redis(const std::string& a) {
    return a.rfind("redis://", 0) == 0 || a.rfind("rediss://", 0) == 0;
}

[[noreturn]] void unknown(const char* what, const std::string& address) {
    MOERL_FAIL("unknown ", what, " address '", address, "': expected 'embedded'",
#ifdef MOERL_HAVE_REDIS
               " or redis://host:port"
#else
               " (this build has no Redis support)"
#endif
    );
}
}  // namespace

std::unique_ptr<TaskQueue> make_task_queue(const std::string& address, const std::string& run_id,
                                           Millis lease_timeout) {
    if (address.empty() || address == "embedded") return make_embedded_task_queue(run_id, lease_timeout);
#ifdef MOERL_HAVE_REDIS
    if (is_redis(address)) return make_redis_task_queue(address, run_id, lease_timeout);
#endif
    unknown("task queue", address);
}

std::unique_ptr<ExperienceBuffer> make_experience_buffer(const std::string& address,
                                                         const std::string& run_id) {
    if (address.empty() || address == "embedded") return make_embedded_experience_buffer(run_id);
#ifdef MOERL_HAVE_REDIS
    if (is_redis(address)) return make_redis_experience_buffer(address, run_id);
#endif
    unknown("experience buffer", address);
}

std::unique_ptr<Registry> make_registry(const std::string& address, const std::string& run_id) {
    if (address.empty() || address == "embedded") return make_embedded_registry(run_id);
#ifdef MOERL_HAVE_REDIS
    if (is_redis(address)) return make_redis_registry(address, run_id);
#endif
    unknown("registry", address);
}

std::unique_ptr<CheckpointStore> make_checkpoint_store(const std::string& uri) {
    if (uri.rfind("s3://", 0) == 0) {
#ifdef MOERL_HAVE_S3
        return make_s3_checkpoint_store(uri);
#else
        MOERL_FAIL("checkpoint store '", uri, "': this build has no S3 support (libcurl not found)");
#endif
    }
    if (uri.rfind("file://", 0) == 0) return make_file_checkpoint_store(uri.substr(7));
    MOERL_CHECK(uri.find("://") == std::string::npos, "unknown checkpoint store URI '", uri,
                "': expected file:///dir, a path, or s3://bucket/prefix");
    return make_file_checkpoint_store(uri);
}

}  // namespace moerl::control
