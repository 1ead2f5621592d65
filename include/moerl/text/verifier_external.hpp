// A verifier that is a user's program, in any language, kept running as a child process.
//
// Protocol: one JSON object a line each way. moerl writes {"id": N, "response": "...", "example":
// {...the example's line...}} to the program's stdin; the program answers {"id": N, "reward": R}
// on stdout (R a number in [0, 1]; an optional "details" value is passed on), flushing after each
// line, in any order. Diagnostics go to stderr, which moerl forwards to its own and quotes in errors.
// Ids are unique over the verifier's life, so no answer is matched to the wrong item.
//
// Failures: when the program exits, is killed, closes stdout, or gives no answer within timeout_s of
// the previous answer (of the batch start, at first; startup_timeout_s more for the first answer after
// it starts), it is killed (its whole process group) and
// started again, and the items not yet answered are sent again; the oldest of them is taken as the
// one that failed. An item that fails twice, or max_restarts restarts in a row without an answer in
// between, ends the batch with a moerl::Error naming the command, the item and what happened (exit
// status, signal or timeout) with the end of its stderr. Each item is scored exactly once: answers
// are matched by id, and an unknown or repeated id, a line that is not JSON, or a reward that is not a
// number in [0, 1] is an error (the program is then stopped and restarted at the next batch).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "moerl/text/verifier.hpp"

namespace moerl::text {

class ExternalVerifier final : public Verifier {
  public:
    // Starts the program; throws when it cannot be started.
    explicit ExternalVerifier(const ExternalOptions& options);
    // Closes its stdin, waits up to 2 s for it to exit, then kills it.
    ~ExternalVerifier() override;

    std::string name() const override { return "external"; }
    Verdict score(std::string_view response, const Example& example) override;
    // Writes the whole batch ahead (non-blocking) while reading answers. One batch at a time: calls
    // from several threads are serialised.
    std::vector<Verdict> score_batch(const std::vector<Scoring>& batch) override;

    struct Stats {
        uint64_t items = 0;     // items scored
        uint64_t restarts = 0;  // times the program was started again after a failure
        uint64_t retries = 0;   // items sent again after a failure
    };
    Stats stats() const;

  private:
    struct Impl;
    mutable std::mutex mu_;
    std::unique_ptr<Impl> impl_;  // guarded by mu_
};

}  // namespace moerl::text
