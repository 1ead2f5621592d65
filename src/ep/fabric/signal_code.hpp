// Internal: how a fabric write announces itself in 32 bits of remote CQ data, and how the receiver
// turns chunk completions back into per-message signals.
//
// EFA and verbs carry 4 bytes of CQ data, so every provider gets the same 32-bit layout:
//   [31:19] source rank  [18:15] channel  [14:10] message sequence mod kSeqWindow  [9:0] chunks of the
//   message
// The sequence number matters because a reliable-datagram provider (EFA's SRD) may complete the chunks
// of two messages on the same (channel, source) interleaved: counting chunks alone could report a
// later message complete while an earlier one still has data in flight.
#pragma once

#include <array>
#include <cstdint>

#include "moerl/core/error.hpp"
#include "moerl/ep/transport.hpp"

namespace moerl::ep::fabric {

constexpr int kChunkBits = 10;
constexpr int kSeqBits = 5;
constexpr int kChannelBits = 4;
constexpr int kRankBits = 13;
static_assert(kChunkBits + kSeqBits + kChannelBits + kRankBits == 32);
static_assert(kNumChannels <= (1 << kChannelBits), "channel ids must fit in the CQ data");

constexpr int kMaxRanks = 1 << kRankBits;
constexpr uint32_t kMaxChunks = (1u << kChunkBits) - 1;
// Messages per (peer, channel) that may be in flight at once; the sender waits for the oldest
// message's local completion before reusing its sequence slot.
constexpr uint32_t kSeqWindow = 1u << kSeqBits;

struct SignalCode {
    int src = 0;
    int channel = 0;
    uint32_t seq = 0;         // message sequence number mod kSeqWindow
    uint32_t num_chunks = 0;  // 1..kMaxChunks
};

inline uint32_t encode(const SignalCode& c) {
    return (static_cast<uint32_t>(c.src) << (kChunkBits + kSeqBits + kChannelBits)) |
           (static_cast<uint32_t>(c.channel) << (kChunkBits + kSeqBits)) | (c.seq << kChunkBits) |
           c.num_chunks;
}

inline SignalCode decode(uint64_t data) {
    const auto bits = static_cast<uint32_t>(data);
    SignalCode c;
    c.num_chunks = bits & kMaxChunks;
    c.seq = (bits >> kChunkBits) & (kSeqWindow - 1);
    c.channel = static_cast<int>((bits >> (kChunkBits + kSeqBits)) & ((1u << kChannelBits) - 1));
    c.src = static_cast<int>(bits >> (kChunkBits + kSeqBits + kChannelBits));
    return c;
}

// Receiver-side accounting for one (source, channel): counts chunks per sequence slot and reports
// messages complete in the order they were sent.
class ReceiveLane {
  public:
    // Records one chunk; returns how many messages became complete (in send order) because of it.
    uint32_t on_chunk(uint32_t seq, uint32_t num_chunks) {
        MOERL_CHECK(seq < kSeqWindow && num_chunks >= 1 && num_chunks <= kMaxChunks,
                    "fabric: malformed signal: seq ", seq, ", chunks ", num_chunks);
        MOERL_CHECK(expected_[seq] == 0 || expected_[seq] == num_chunks, "fabric: chunk of message slot ",
                    seq, " says ", num_chunks, " chunks, an earlier one said ", expected_[seq]);
        expected_[seq] = static_cast<uint16_t>(num_chunks);
        ++arrived_[seq];
        MOERL_CHECK(arrived_[seq] <= num_chunks, "fabric: message slot ", seq, " got ", arrived_[seq],
                    " chunks, expected ", num_chunks, " (sequence window overrun)");
        uint32_t num_done = 0;
        while (expected_[next_seq_] != 0 && arrived_[next_seq_] == expected_[next_seq_]) {
            expected_[next_seq_] = 0;
            arrived_[next_seq_] = 0;
            next_seq_ = (next_seq_ + 1) % kSeqWindow;
            ++num_done;
        }
        return num_done;
    }

  private:
    uint32_t next_seq_ = 0;  // slot of the oldest message not yet complete
    std::array<uint16_t, kSeqWindow> arrived_{};
    std::array<uint16_t, kSeqWindow> expected_{};  // 0 = no chunk of this slot seen yet
};

}  // namespace moerl::ep::fabric
