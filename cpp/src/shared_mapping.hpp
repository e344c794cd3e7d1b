// Internal: a file in shared memory mapped read-write, with the checks every attach needs.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace elastic::detail {

class SharedMapping {
 public:
  /// Create `path` exclusively with `size` zeroed bytes. `what` names the object in errors
  /// ("heartbeat table", "barrier").
  static std::unique_ptr<SharedMapping> create(const std::string& path, size_t size,
                                               const char* what);
  /// Map an existing file whole; `min_size` is the least a valid file can have.
  static std::unique_ptr<SharedMapping> open(const std::string& path, size_t min_size,
                                             const char* what);
  /// `size` zeroed bytes in a memfd sealed against shrinking and growing (no process can cut
  /// the pages under another's mapping: a SIGBUS there would kill it), found through a small
  /// locator file created exclusively at `path` ("elasticrun-sealed PID FD"), which this
  /// mapping removes when destroyed. The memfd stays open here: others reach it through
  /// /proc/PID/fd/FD while its creator lives.
  static std::unique_ptr<SharedMapping> create_sealed(const std::string& path, size_t size,
                                                      const char* what);
  /// Map the sealed memfd that the locator at `path` names; refuses one that is not sealed.
  static std::unique_ptr<SharedMapping> open_sealed(const std::string& path, size_t min_size,
                                                    const char* what);

  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }
  /// Remove the file when this mapping is destroyed.
  void unlink_on_close() noexcept { unlink_ = true; }

 private:
  SharedMapping(std::string path, void* data, size_t size, int fd = -1)
      : path_(std::move(path)), data_(data), size_(size), fd_(fd) {}

  std::string path_;
  void* data_;
  size_t size_;
  int fd_;  // the sealed memfd its creator keeps open, else -1
  bool unlink_ = false;
};

/// Reject paths that cannot name a shared-memory file before touching the file system.
void check_path(const std::string& path, const char* what);

/// open(path, O_CREAT | O_EXCL | `flags`, 0600); an error that says "the file exists" (and what
/// to do) or why else it failed.
int create_exclusive(const std::string& path, int flags, const char* what);

/// open(path, `flags`) of a file that must exist; an error that says it does not, or why else.
int open_existing(const std::string& path, int flags, const char* what);

}  // namespace elastic::detail
