// The EP bootstrap Store on top of any c10d store (TCPStore, PrefixStore): what the launcher, the
// benchmarks and the trainer's processes rendezvous through. Header-only; needs LibTorch's c10d.
#pragma once

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "moerl/core/error.hpp"
#include "moerl/ep/store.hpp"

namespace moerl::ep {

class C10dStore final : public Store {
  public:
    explicit C10dStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
    void set(const std::string& key, const std::vector<uint8_t>& value) override { store_->set(key, value); }
    std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
        try {
            store_->wait({key}, timeout);
        } catch (const std::exception& e) {
            throw TimeoutError("c10d store: key '" + key + "' did not appear within " +
                                   std::to_string(timeout.count()) + " ms (" + e.what() + ")",
                               __FILE__, __LINE__);
        }
        return store_->get(key);
    }

  private:
    c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace moerl::ep
