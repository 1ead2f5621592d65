#include "moerl/control/deferred_ack.hpp"

#include <utility>

#include "moerl/core/error.hpp"

namespace moerl::control {

DeferredAckBuffer::DeferredAckBuffer(std::unique_ptr<ExperienceBuffer> inner) : inner_(std::move(inner)) {
    MOERL_CHECK(inner_ != nullptr, "DeferredAckBuffer: no experience buffer to wrap");
}

bool DeferredAckBuffer::push(const Experience& experience) { return inner_->push(experience); }

std::vector<Delivery> DeferredAckBuffer::take(const std::string& consumer, size_t max, Millis wait) {
    return inner_->take(consumer, max, wait);
}

void DeferredAckBuffer::ack(const std::vector<std::string>& delivery_ids) {
    std::lock_guard lock(mutex_);
    pending_.insert(pending_.end(), delivery_ids.begin(), delivery_ids.end());
}

size_t DeferredAckBuffer::size() { return inner_->size(); }

size_t DeferredAckBuffer::commit() {
    std::vector<std::string> ids;
    {
        std::lock_guard lock(mutex_);
        ids = std::exchange(pending_, {});
    }
    if (ids.empty()) return 0;
    try {
        inner_->ack(ids);
    } catch (...) {
        std::lock_guard lock(mutex_);  // not acknowledged: the next commit tries again
        pending_.insert(pending_.begin(), ids.begin(), ids.end());
        throw;
    }
    return ids.size();
}

size_t DeferredAckBuffer::uncommitted() {
    std::lock_guard lock(mutex_);
    return pending_.size();
}

}  // namespace moerl::control
