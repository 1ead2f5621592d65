// Trainer -> rollout weight sync between machines by a collective broadcast (sync.transfer:
// broadcast in distributed mode): the trainer hosts a rendezvous store (c10d's TCPStore) and, at
// each new version, broadcasts its weights from its rank 0 to the rollout workers that joined, over
// c10d's Gloo (host memory) or NCCL (CUDA weights on both sides, where the build has it). No policy
// files go through the checkpoint store; the trainer's durable checkpoints still do.
//
// Rollout workers come and go (spot nodes), so the group is re-formed in generations. Keys, all in
// the trainer's store:
//   "join/count", "join/N"   a worker asks to be sent the policies (its name)
//   "announce"              {gen, version, backend, candidates}: the send in progress or last sent
//   "ready/G/NAME"          a candidate of generation G is there and waits for the roster
//   "roster/G"              the members of G (rank = index + 1; the trainer is rank 0)
//   "header/V"              the tensors of version V: name, first expert, shape, dtype, in order
// A send to an unchanged group is one broadcast per tensor. The group is formed anew when workers
// joined, or after a failure: the trainer announces the candidates, waits up to join_timeout_s for
// each to say it is ready, and forms the group from those that did (a dead worker is left out). A
// failed broadcast (a member died) closes the trainer's side of the group at once, so the other
// members' receives fail too; the trainer then forms a new generation from the same candidates and
// sends the version again. A receiver that failed in a generation never enters it again: it asks to
// join, and the trainer sends it the current version at its next chance (TrainerRole serves joiners
// while it waits for experiences).
//
// Why a collective and not the store: a 30B-parameter policy every step through S3 costs minutes
// of upload and download a step; NCCL over EFA moves it in seconds, and a broadcast sends each byte
// out of the trainer once per member only where the backend has no tree (Gloo), once in all with
// NCCL's ring. Why generations and not one group for the run: NCCL and Gloo groups cannot lose or
// gain a member.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moerl/model/model.hpp"

namespace moerl::rl::detail {

// The weights of one trainer rank (as TrainerRankWeights): experts first_expert.. in its stacks.
struct BroadcastSource {
    int first_expert = 0;
    std::vector<model::NamedParameter> weights;
};

struct BroadcastOptions {
    std::string address;         // advertised to the workers (the trainer's address they can reach)
    int port = 0;                // the store's port; 0: any free one
    double timeout_s = 120;      // a broadcast or group formation that takes longer fails
    double join_timeout_s = 10;  // how long a candidate has to say it is ready
    std::function<void(const std::string&)> log;
};

// Whether this build can broadcast weights at all (c10d's Gloo headers in its LibTorch, or NCCL),
// "" if so, else why not.
std::string policy_broadcast_unavailable();

// "broadcast://HOST:PORT/ID": the trainer's store, and the trainer's id in its own process (a
// reader there copies from memory instead).
bool is_broadcast_uri(const std::string& uri);
std::string broadcast_uri_id(const std::string& uri);

class PolicyBroadcaster {
  public:
    // Starts the store on options.port (throws naming the port when it cannot).
    explicit PolicyBroadcaster(BroadcastOptions options);
    ~PolicyBroadcaster();
    PolicyBroadcaster(const PolicyBroadcaster&) = delete;
    PolicyBroadcaster& operator=(const PolicyBroadcaster&) = delete;

    std::string uri(const std::string& id) const;
    int port() const;

    // Sends `version` to the members and to the workers that asked to join. `announced` runs once
    // the send is announced in the store and before the trainer waits for anyone: it registers the
    // version, which brings the workers. Dense weights come from sources[0], each expert stack from
    // every source. Returns the workers that received it. A failed broadcast is retried twice with
    // a new generation; after that the version waits for the workers to ask again.
    std::vector<std::string> send(int64_t version, const std::vector<BroadcastSource>& sources,
                                  const std::function<void()>& announced);
    // Workers asked to join since the last send.
    bool has_joiners();
    // Sends `version` (already registered) to the workers that asked to join; the others keep their
    // group until the next send. Returns the workers that received it.
    std::vector<std::string> serve_joiners(int64_t version, const std::vector<BroadcastSource>& sources);

    int64_t generation() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

class PolicyReceiver {
  public:
    // `name`: this worker (unique in the run). `target`: the weights to fill (experts
    // first_expert.. in the stacks); they must outlive the receiver.
    PolicyReceiver(std::string name, std::vector<model::NamedParameter> target, int first_expert,
                   double timeout_s, std::function<void(const std::string&)> log = {});
    ~PolicyReceiver();
    PolicyReceiver(const PolicyReceiver&) = delete;
    PolicyReceiver& operator=(const PolicyReceiver&) = delete;

    // Takes part in the send of `version` announced at `uri` and returns the bytes written into the
    // target; nullopt when this worker is not a member for it (it asked to join: the trainer sends
    // it at its next chance) or the trainer is not reachable now. Throws when the broadcast failed
    // part way (the target then holds parts of two versions: incomplete() until a send succeeds)
    // or the trainer's weights do not fit the target (naming the weight).
    std::optional<int64_t> receive(const std::string& uri, int64_t version);
    // A receive failed part way and none has succeeded since.
    bool incomplete() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace moerl::rl::detail
