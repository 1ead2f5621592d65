// The control plane: task queue, experience buffer, version registry and checkpoint store.
// Each interface has an embedded implementation (in-process, local directory; the default, no
// servers) and a distributed one (Redis 7 streams; S3). Records travel as opaque strings
// (serialized by the rl layer), so this layer needs no LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace moerl::control {

using Millis = std::chrono::milliseconds;

struct Task {
    std::string id;       // unique per task in a run (e.g. "step12-prompt3-sample1")
    int attempt = 0;      // how many times it was handed out before (0 = first time)
    std::string payload;  // the task (prompt, metadata), serialized by the producer
    std::string partial;  // a partial trajectory written back by a preempted worker, or empty
};

struct Lease {
    Task task;
    std::string lease_id;  // opaque; identifies this hand-out (a stream entry id in Redis)
    std::string worker;
};

// Tasks leased by workers. A lease not acknowledged or released within the lease timeout (and
// not kept alive by heartbeat) is handed to another worker, attempt + 1.
class TaskQueue {
  public:
    virtual ~TaskQueue() = default;
    virtual void put(const Task& task) = 0;
    // Next task for `worker`, waiting up to `wait`; expired leases of other workers come first.
    virtual std::optional<Lease> lease(const std::string& worker, Millis wait) = 0;
    // The task is done: it is never handed out again. Acknowledging twice is harmless.
    virtual void ack(const Lease& lease) = 0;
    // Gives the task back now (preemption), with the partial trajectory for whoever resumes it.
    virtual void release(const Lease& lease, const std::string& partial) = 0;
    // Keeps the worker's leases alive.
    virtual void heartbeat(const std::string& worker) = 0;
    // Tasks not yet acknowledged (queued or leased).
    virtual size_t outstanding() = 0;
};

struct Experience {
    std::string task_id;  // exactly-once key
    int attempt = 0;
    int64_t policy_version = 0;  // oldest policy version among its tokens
    std::string payload;         // serialized experience record (rl layer)
};

struct Delivery {
    Experience experience;
    std::string delivery_id;  // opaque; pass to ack()
};

// Experience from rollout to the trainer, exactly once per task id.
class ExperienceBuffer {
  public:
    virtual ~ExperienceBuffer() = default;
    // Returns false (and stores nothing) when an experience with this task id was already pushed.
    virtual bool push(const Experience& experience) = 0;
    // Up to `max` experiences not yet delivered to `consumer`, waiting up to `wait` for the first.
    virtual std::vector<Delivery> take(const std::string& consumer, size_t max, Millis wait) = 0;
    // The step that used these is durable: they are gone for good. Unacknowledged deliveries of a
    // consumer that restarts are delivered again.
    virtual void ack(const std::vector<std::string>& delivery_ids) = 0;
    virtual size_t size() = 0;  // pushed and not yet acknowledged
};

// Policy versions published by the trainer; versions only increase.
class Registry {
  public:
    virtual ~Registry() = default;
    // Throws moerl::Error when version <= the latest published one.
    virtual void publish(int64_t version, const std::string& checkpoint_uri) = 0;
    // Latest (version, uri), or nullopt before the first publish.
    virtual std::optional<std::pair<int64_t, std::string>> latest() = 0;
};

// Files under a root: a local directory (file://) or an S3 prefix (s3://bucket/prefix).
class CheckpointStore {
  public:
    virtual ~CheckpointStore() = default;
    virtual std::string uri() const = 0;
    virtual void put_file(const std::string& key, const std::string& local_path) = 0;
    virtual void get_file(const std::string& key, const std::string& local_path) = 0;
    virtual bool exists(const std::string& key) = 0;
    virtual std::vector<std::string> list(const std::string& prefix) = 0;
    virtual void remove(const std::string& key) = 0;
};

// A checkpoint is a directory of files plus manifest.json (version, step, sha256 and size per
// file) written last; readers trust only checkpoints whose manifest exists and whose files match.
struct Manifest {
    int64_t version = 0;
    int64_t step = 0;
    std::map<std::string, std::pair<std::string, uint64_t>> files;  // name -> (sha256 hex, bytes)
};
// Uploads every file of local_dir under name/, then name/manifest.json.
Manifest publish_checkpoint(CheckpointStore& store, const std::string& local_dir, const std::string& name,
                            int64_t version, int64_t step);
// Downloads name/ into local_dir (through cache_dir when given), verifying every sha256.
Manifest fetch_checkpoint(CheckpointStore& store, const std::string& name, const std::string& local_dir,
                          const std::string& cache_dir = "");

// Checks a checkpoint directory on local disk against its manifest.json: every listed file present
// with its size and sha256, no safetensors file beside them that it does not list. Returns the
// manifest, or nullopt when the directory has none (e.g. a checkpoint written by another tool);
// throws naming the first file that does not match.
std::optional<Manifest> verify_checkpoint_dir(const std::string& dir);

std::string sha256_file(const std::string& path);
// Parses manifest.json text; `source` names it in errors.
Manifest manifest_from_json(const std::string& text, const std::string& source);

// Backends by address: "embedded" (in-process, shared by everything in this process under the
// same run id) or "redis://[:password@]host:port[/db]" (distributed). Stores by URI: "file:///dir",
// a plain path, or "s3://bucket/prefix".
std::unique_ptr<TaskQueue> make_task_queue(const std::string& address, const std::string& run_id,
                                           Millis lease_timeout);
std::unique_ptr<ExperienceBuffer> make_experience_buffer(const std::string& address,
                                                         const std::string& run_id);
std::unique_ptr<Registry> make_registry(const std::string& address, const std::string& run_id);
std::unique_ptr<CheckpointStore> make_checkpoint_store(const std::string& uri);

}  // namespace moerl::control
