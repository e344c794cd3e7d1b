#include "shared_mapping.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "elastic/error.hpp"
#include "util.hpp"

namespace elastic::detail {

void check_path(const std::string& path, const char* what) {
  if (path.empty() || path[0] != '/') {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                std::string(what) + " path '" + path +
                    "' is not absolute: give a full path, for example /dev/shm/elastic-job1");
  }
  if (path.size() >= 4096) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT, std::string(what) + " path is longer than 4095 bytes");
  }
}

std::unique_ptr<SharedMapping> SharedMapping::create(const std::string& path, size_t size,
                                                     const char* what) {
  check_path(path, what);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    int err = errno;
    if (err == EEXIST) {
      throw Error(ELASTIC_ERR_STATE, std::string("cannot create ") + what + " '" + path +
                                         "': the file exists; remove it if no job uses it, or "
                                         "choose another path");
    }
    throw system_error(err, std::string("cannot create ") + what + " '" + path + "'");
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    throw system_error(err, std::string("cannot size ") + what + " '" + path + "' to " +
                                std::to_string(size) + " bytes (is the file system full?)");
  }
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) {
    ::unlink(path.c_str());
    throw system_error(err, std::string("cannot map ") + what + " '" + path + "'");
  }
  auto mapping = std::unique_ptr<SharedMapping>(new SharedMapping(path, data, size));
  mapping->unlink_on_close();
  return mapping;
}

std::unique_ptr<SharedMapping> SharedMapping::open(const std::string& path, size_t min_size,
                                                   const char* what) {
  check_path(path, what);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) {
      throw Error(ELASTIC_ERR_BAD_FILE, std::string("no ") + what + " at '" + path +
                                            "': the file does not exist (has its supervisor "
                                            "created it, or already exited?)");
    }
    if (err == EISDIR) {
      throw Error(ELASTIC_ERR_BAD_FILE,
                  std::string("'") + path + "' is a directory, not a regular file, so not a " + what);
    }
    throw system_error(err, std::string("cannot open ") + what + " '" + path + "'");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw system_error(err, std::string("cannot stat ") + what + " '" + path + "'");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(ELASTIC_ERR_BAD_FILE,
                std::string("'") + path + "' is not a regular file, so not a " + what);
  }
  auto size = static_cast<size_t>(st.st_size);
  if (size < min_size) {
    ::close(fd);
    throw Error(ELASTIC_ERR_BAD_FILE, std::string("'") + path + "' is not a valid " + what +
                                          ": it is truncated (" + std::to_string(size) +
                                          " bytes, a valid one has at least " +
                                          std::to_string(min_size) + ")");
  }
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) {
    throw system_error(err, std::string("cannot map ") + what + " '" + path + "'");
  }
  return std::unique_ptr<SharedMapping>(new SharedMapping(path, data, size));
}

SharedMapping::~SharedMapping() {
  ::munmap(data_, size_);
  if (unlink_) ::unlink(path_.c_str());
}

}  // namespace elastic::detail
