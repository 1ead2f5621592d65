// Counting wrong elements in EP tests: every comparison is recorded, the first few are described, and
// done() throws naming how many were wrong.
#pragma once

#include <string>
#include <utility>

#include "moerl/core/error.hpp"

namespace moerl::test {

class Mismatches {
  public:
    explicit Mismatches(std::string what) : what_(std::move(what)) {}
    void expect(bool ok, const std::string& where) {
        if (ok) return;
        if (count_++ < 5) first_ += "\n  " + where;
    }
    void done() const { MOERL_CHECK(count_ == 0, what_, ": ", count_, " wrong elements", first_); }

  private:
    std::string what_;
    long count_ = 0;
    std::string first_;
};

}  // namespace moerl::test
