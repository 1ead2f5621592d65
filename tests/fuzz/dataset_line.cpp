// Fuzz target: the JSONL training data of a run (data.path). The input is parsed as one line by
// parse_example under two formats (the default field names, and renamed fields without a required
// answer), and read as a whole file through JsonlFile, the way a Dataset opens it.
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "fuzz_target.hpp"
#include "moerl/text/dataset.hpp"

namespace {

using moerl::fuzz::require;
using moerl::text::Example;
using moerl::text::JsonlFormat;

const JsonlFormat& renamed_format() {
    static const JsonlFormat format = [] {
        JsonlFormat f;
        f.prompt_field = "question";
        f.messages_field = "conversation";
        f.answer_field = "solution";
        f.id_field = "uid";
        f.require_answer = false;
        return f;
    }();
    return format;
}

// What an accepted example promises: a prompt or a non-empty list of messages with string roles
// (not both), an answer when the format requires one, the whole line's object in `fields`.
void require_promised(const Example& ex, const JsonlFormat& f, const std::string& where) {
    require(ex.where == where, "where is as given");
    require(ex.fields.is_object(), "fields is the line's object");
    if (ex.messages.is_null()) {
        require(ex.fields.contains(f.prompt_field) && ex.fields[f.prompt_field].is_string(),
                "a string prompt");
        require(!ex.fields.contains(f.messages_field), "not both prompt and messages");
    } else {
        require(ex.prompt.empty() && ex.messages.is_array() && !ex.messages.empty(), "non-empty messages");
        for (const auto& m : ex.messages)
            require(m.is_object() && m.contains("role") && m["role"].is_string(), "each message has a role");
    }
    require(!f.require_answer || ex.fields.contains(f.answer_field), "the required answer is there");
    require(!ex.id.empty() || ex.fields.contains(f.id_field), "an id, or where as the id");
}

// The input as a dataset file: a memfd named by /proc/self/fd, so nothing touches the disk.
void read_as_file(const std::string& text) {
    const int fd = memfd_create("fuzz.jsonl", MFD_CLOEXEC);
    if (fd < 0) return;
    const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    const std::string path = "/proc/self/fd/" + std::to_string(fd);
    try {
        if (written) {
            const moerl::text::JsonlFile file(path);
            require(file.size() >= 1, "an opened file holds an example");
            require(file.file_bytes() == text.size(), "file_bytes is the file's size");
            uint64_t previous_line = 0;
            for (uint64_t i = 0; i < file.size(); ++i) {
                // Every line was validated at open, so reading it again must succeed.
                Example ex;
                try {
                    ex = file.read(i);
                } catch (const moerl::Error&) {
                    require(false, "a validated line reads back");
                }
                const uint64_t line = file.line_number(i);
                require(line > previous_line, "line numbers increase");
                previous_line = line;
                require_promised(ex, {}, path + ":" + std::to_string(line));
            }
        }
    } catch (...) {
        ::close(fd);
        throw;
    }
    ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string text = moerl::fuzz::as_text(data, size);
    moerl::fuzz::parse_or_refuse(
        [&] { require_promised(moerl::text::parse_example(text, {}, "data.jsonl:1"), {}, "data.jsonl:1"); });
    moerl::fuzz::parse_or_refuse([&] {
        require_promised(moerl::text::parse_example(text, renamed_format(), "data.jsonl:2"), renamed_format(),
                         "data.jsonl:2");
    });
    return moerl::fuzz::parse_or_refuse([&] { read_as_file(text); });
}
