// Internal: whole-file reads and atomic writes (temporary file + rename) for checkpoint files.
#pragma once

#include <string>
#include <string_view>

namespace moerl::model::detail {

std::string read_text_file(const std::string& path);
// Writes a file through `path.tmp.<pid>` and a rename on commit(), so readers never see a torn
// file. Without commit() the temporary file is removed.
class AtomicWriter {
  public:
    explicit AtomicWriter(const std::string& path);
    ~AtomicWriter();
    AtomicWriter(const AtomicWriter&) = delete;
    AtomicWriter& operator=(const AtomicWriter&) = delete;
    void write(const void* data, size_t size);
    void commit();

  private:
    std::string path_, tmp_;
    int fd_ = -1;
    size_t written_ = 0;
};

void write_file_atomic(const std::string& path, const void* data, size_t size);
inline void write_file_atomic(const std::string& path, std::string_view text) {
    write_file_atomic(path, text.data(), text.size());
}
std::string join_path(const std::string& dir, const std::string& name);

}  // namespace moerl::model::detail
