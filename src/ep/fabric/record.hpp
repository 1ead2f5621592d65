// Internal: byte packing for the bootstrap record each rank publishes (endpoint name, region base,
// memory key). Native byte order: all ranks of a job run the same binary on the same architecture.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "moerl/core/error.hpp"

namespace moerl::ep::fabric {

class Packer {
  public:
    template <typename T>
    void put(const T& v) {
        const auto* p = reinterpret_cast<const uint8_t*>(&v);
        bytes_.insert(bytes_.end(), p, p + sizeof(T));
    }
    // Length-prefixed.
    void put_bytes(const std::vector<uint8_t>& b) {
        put(static_cast<uint32_t>(b.size()));
        bytes_.insert(bytes_.end(), b.begin(), b.end());
    }
    const std::vector<uint8_t>& bytes() const { return bytes_; }

  private:
    std::vector<uint8_t> bytes_;
};

// Reads what Packer wrote; a short record is an error naming the rank that published it.
class Unpacker {
  public:
    Unpacker(const std::vector<uint8_t>& bytes, int src) : bytes_(bytes), src_(src) {}
    template <typename T>
    T get() {
        need(sizeof(T));
        T v;
        std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    std::vector<uint8_t> get_bytes() {
        const auto n = get<uint32_t>();
        need(n);
        std::vector<uint8_t> out(bytes_.begin() + pos_, bytes_.begin() + pos_ + n);
        pos_ += n;
        return out;
    }

  private:
    void need(size_t n) {
        MOERL_CHECK(n <= bytes_.size() - pos_, "fabric bootstrap: the record of rank ", src_,
                    " is truncated (", bytes_.size(), " bytes)");
    }
    const std::vector<uint8_t>& bytes_;
    int src_;
    size_t pos_ = 0;
};

}  // namespace moerl::ep::fabric
