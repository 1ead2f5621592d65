// Bootstrap key-value store used by transports to exchange addresses and handles.
// The EP library only needs this small interface; the launcher backs it with c10d's TCPStore.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace moerl::ep {

class Store {
  public:
    virtual ~Store() = default;
    // Publishes a value under key (overwrites).
    virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
    // Waits until key exists and returns it; throws moerl::TimeoutError naming the key after timeout.
    virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// A store in a directory shared by the ranks of one machine (values written atomically by rename).
std::unique_ptr<Store> make_file_store(const std::string& dir);

// Collective helper: every rank publishes `mine` under prefix/rank and reads all ranks' values.
std::vector<std::vector<uint8_t>> all_gather(Store& store, const std::string& prefix, int rank,
                                             int world_size, const std::vector<uint8_t>& mine,
                                             std::chrono::milliseconds timeout);

}  // namespace moerl::ep
