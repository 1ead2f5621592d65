// Acknowledgement at commit: the trainer acknowledges experiences right after the step that used
// them, but that step is durable only once its checkpoint is published. DeferredAckBuffer holds
// those acknowledgements and passes them on only at commit(), so the experiences of a trainer
// killed between its step and the checkpoint are delivered again to its successor.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "moerl/control/control.hpp"

namespace moerl::control {

class DeferredAckBuffer final : public ExperienceBuffer {
  public:
    explicit DeferredAckBuffer(std::unique_ptr<ExperienceBuffer> inner);

    bool push(const Experience& experience) override;
    std::vector<Delivery> take(const std::string& consumer, size_t max, Millis wait) override;
    // Only remembers the deliveries: they stay unacknowledged in the wrapped buffer until commit().
    void ack(const std::vector<std::string>& delivery_ids) override;
    size_t size() override;

    // Acknowledges in the wrapped buffer everything ack()ed so far. Call once the checkpoint that
    // holds the steps using them is published. Returns how many deliveries were acknowledged.
    size_t commit();
    // Acknowledged by the consumer but not yet committed.
    size_t uncommitted();

  private:
    std::unique_ptr<ExperienceBuffer> inner_;
    std::mutex mutex_;
    std::vector<std::string> pending_;  // GUARDED_BY(mutex_)
};

}  // namespace moerl::control
