// JSONL datasets of prompts for RL: one example a line, read streaming from an index of line offsets,
// shuffled per epoch by seed without storing a permutation, with an eval split and a resumable
// position (epoch, index) that a checkpoint stores.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace moerl::text {

// One line of a dataset file.
struct Example {
    std::string where;        // "path:line", for messages about this example
    std::string id;           // the id field when present, else "path:line"
    std::string prompt;       // the prompt field; empty when the example has messages instead
    nlohmann::json messages;  // the messages field (array of {"role", "content", ...}); null when absent
    std::string answer;       // the answer field (a JSON number becomes its text); empty when absent
    nlohmann::json fields;    // the whole line's object: verifiers read their metadata here
};

// Field names and checks for one file.
struct JsonlFormat {
    std::string prompt_field = "prompt";      // a string
    std::string messages_field = "messages";  // an array of objects with a string "role"
    std::string answer_field = "answer";      // a string or a number
    std::string id_field = "id";              // optional; a string or a number
    bool require_answer = true;               // false for verifiers that read other fields (countdown)
};

// The lines of one JSONL file, found by offset: opening reads the file once to record where each
// example starts (8 bytes an example; the text stays on disk) and, when `validate`, parses every
// line so that a malformed one fails at open rather than hours into a run. Blank lines are skipped,
// CRLF endings and a UTF-8 byte-order mark accepted. read() is thread-safe (pread).
class JsonlFile {
  public:
    // Throws moerl::Error naming the file and line of the first malformed line (bad JSON, not an
    // object, no prompt or messages, a field of the wrong type), and for an empty file.
    JsonlFile(std::string path, JsonlFormat format = {}, bool validate = true);
    ~JsonlFile();
    JsonlFile(const JsonlFile&) = delete;
    JsonlFile& operator=(const JsonlFile&) = delete;

    const std::string& path() const { return path_; }
    uint64_t size() const { return offsets_.size(); }
    // The i-th example (0-based, blank lines not counted).
    Example read(uint64_t i) const;
    // Its 1-based line number in the file.
    uint64_t line_number(uint64_t i) const;
    // Bytes of memory the index holds (offsets and blank-line records), not counting the object.
    uint64_t index_bytes() const;
    uint64_t file_bytes() const { return file_bytes_; }

  private:
    std::string read_line(uint64_t i) const;
    std::string path_;
    JsonlFormat format_;
    int fd_ = -1;
    uint64_t file_bytes_ = 0;
    std::vector<uint64_t> offsets_;        // byte offset where each example's line starts
    std::vector<uint64_t> blanks_before_;  // per blank line: the number of examples before it
};

// Parses one line as an example (exposed for tests and for callers with their own storage).
// Throws moerl::Error prefixed by `where`.
Example parse_example(const std::string& line, const JsonlFormat& format, const std::string& where);

// Where a run is in the training data: the index-th example of epoch `epoch`'s order. A checkpoint
// stores it (to_json) and a resumed run continues from it exactly.
struct DataPosition {
    uint64_t epoch = 0;
    uint64_t index = 0;
    bool operator==(const DataPosition&) const = default;
};

struct DatasetOptions {
    std::string path;            // data.path: the training JSONL file (required)
    std::string eval_path;       // data.eval_path: a separate eval file; empty = hold out eval_fraction
    double eval_fraction = 0.0;  // data.eval_fraction in [0, 1): share of `path` held out for eval
                                 // (chosen by seed); not with eval_path
    uint64_t eval_limit = 0;     // data.eval_limit: evaluate at most this many examples; 0 = all
    uint64_t eval_every = 0;     // data.eval_every: training steps between greedy evals of the eval split
                                 // (read by the training loop); 0 = never
    uint64_t seed = 0;           // data.seed: the shuffle and the held-out choice
    bool shuffle = true;         // data.shuffle: false keeps one fixed order every epoch (file order
                                 // unless eval_fraction holds lines out)
    uint64_t epochs = 0;         // data.epochs: passes over the training split; 0 = no limit
    bool validate = true;        // data.validate: parse every line at open; false only indexes (much
                                 // faster on a huge file) and a bad line fails when it is read
    JsonlFormat format;          // data.prompt_field, .messages_field, .answer_field, .id_field,
                                 // .require_answer

    // Throws moerl::Error naming the field and its limits.
    void validate_options() const;
};

// Training and eval splits over one or two JsonlFiles. The order of epoch e is a pseudo-random
// permutation of the training split keyed by (seed, e), computed per index by a Feistel network
// (nothing stored, so memory stays at the offsets and any position is reachable in O(1)).
class Dataset {
  public:
    explicit Dataset(const DatasetOptions& options);
    ~Dataset();

    uint64_t train_size() const { return num_train_; }
    uint64_t eval_size() const;
    const DatasetOptions& options() const { return options_; }

    // The example at `pos`; throws when pos.index >= train_size() or pos.epoch >= epochs (if set).
    Example train(const DataPosition& pos) const;
    // The next example from `pos`, which then moves on; nullopt (pos unchanged) after the last epoch.
    std::optional<Example> next(DataPosition& pos) const;
    // The position `count` examples after `pos` (epochs roll over). A run that takes P prompts a
    // step can find step s's first prompt at advance({}, s * P) without reading anything.
    DataPosition advance(const DataPosition& pos, uint64_t count) const;
    // The i-th eval example, i < eval_size(): file order for eval_path, a fixed order chosen by seed
    // for a held-out fraction (the eval set is the same whatever the epoch).
    Example eval(uint64_t i) const;

    // Bytes of memory held by the indexes: the offsets, nothing of the text.
    uint64_t index_bytes() const;

    // {"epoch", "index", "train_size", "seed"}: what a checkpoint stores.
    nlohmann::json state(const DataPosition& pos) const;
    // The position in `state`; throws when the checkpoint was made with another dataset size or seed
    // (a resumed run would otherwise silently read other examples).
    DataPosition restore(const nlohmann::json& state) const;

  private:
    uint64_t train_line(const DataPosition& pos) const;
    DatasetOptions options_;
    std::unique_ptr<JsonlFile> train_file_;
    std::unique_ptr<JsonlFile> eval_file_;  // null when the eval split is held out of train_file_
    uint64_t num_train_ = 0;
    uint64_t num_held_out_ = 0;
};

// A pseudo-random permutation of [0, n) keyed by `key`: a balanced Feistel network over the next
// even power of two, walking the cycle until the value falls inside [0, n). O(1) memory.
uint64_t permute(uint64_t index, uint64_t n, uint64_t key);

}  // namespace moerl::text
