// Internal: constructors of each backend, wired by factory.cpp.
#pragma once

#include "moerl/control/control.hpp"

namespace moerl::control {

// embedded.cpp: in-process, shared by every caller in this process that names the same run id.
std::unique_ptr<TaskQueue> make_embedded_task_queue(const std::string& run_id, Millis lease_timeout);
std::unique_ptr<ExperienceBuffer> make_embedded_experience_buffer(const std::string& run_id);
std::unique_ptr<Registry> make_embedded_registry(const std::string& run_id);
// file_store.cpp: a local directory.
std::unique_ptr<CheckpointStore> make_file_checkpoint_store(const std::string& dir);

#ifdef MOERL_HAVE_REDIS
// redis_*.cpp: Redis 7 streams with consumer groups; keys namespaced "moerl:{run_id}:...".
std::unique_ptr<TaskQueue> make_redis_task_queue(const std::string& url, const std::string& run_id,
                                                 Millis lease_timeout);
std::unique_ptr<ExperienceBuffer> make_redis_experience_buffer(const std::string& url,
                                                               const std::string& run_id);
std::unique_ptr<Registry> make_redis_registry(const std::string& url, const std::string& run_id);
#endif
#ifdef MOERL_HAVE_S3
// s3_store.cpp: S3 through libcurl with SigV4.
std::unique_ptr<CheckpointStore> make_s3_checkpoint_store(const std::string& uri);
#endif

}  // namespace moerl::control
