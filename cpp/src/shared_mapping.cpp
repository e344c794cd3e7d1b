#include "shared_mapping.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
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

int create_exclusive(const std::string& path, int flags, const char* what) {
  int fd = ::open(path.c_str(), flags | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
  int err = errno;
  if (err == EEXIST) {
    throw Error(ELASTIC_ERR_STATE, std::string("cannot create ") + what + " '" + path +
                                       "': the file exists; remove it if no job uses it, or "
                                       "choose another path");
  }
  throw system_error(err, std::string("cannot create ") + what + " '" + path + "'");
}

int open_existing(const std::string& path, int flags, const char* what) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd >= 0) return fd;
  int err = errno;
  if (err == ENOENT) {
    throw Error(ELASTIC_ERR_BAD_FILE, std::string("no ") + what + " at '" + path +
                                          "': the file does not exist (has its creator made it, "
                                          "or already exited?)");
  }
  if (err == EISDIR) {
    throw Error(ELASTIC_ERR_BAD_FILE,
                std::string("'") + path + "' is a directory, not a regular file, so not a " + what);
  }
  throw system_error(err, std::string("cannot open ") + what + " '" + path + "'");
}

std::unique_ptr<SharedMapping> SharedMapping::create(const std::string& path, size_t size,
                                                     const char* what) {
  check_path(path, what);
  int fd = create_exclusive(path, O_RDWR, what);
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
  int fd = open_existing(path, O_RDWR, what);
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

namespace {

constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW;

// The locator's one line: "elasticrun-sealed PID FD\n".
std::string locator_line(int fd) {
  return "elasticrun-sealed " + std::to_string(::getpid()) + " " + std::to_string(fd) + "\n";
}

void write_locator(const std::string& path, int memfd, const char* what) {
  int fd = create_exclusive(path, O_WRONLY | O_NOFOLLOW, what);
  const std::string line = locator_line(memfd);
  ssize_t n = ::write(fd, line.data(), line.size());
  int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(line.size())) {
    ::unlink(path.c_str());
    throw system_error(err, std::string("cannot write ") + what + " '" + path + "'");
  }
}

// The "/proc/PID/fd/FD" the locator at `path` names.
std::string read_locator(const std::string& path, const char* what) {
  int fd = open_existing(path, O_RDONLY | O_NOFOLLOW, what);
  char buf[64] = {};
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  long pid = 0, memfd = -1;
  char end = 0;
  if (n <= 0 || std::sscanf(buf, "elasticrun-sealed %ld %ld%c", &pid, &memfd, &end) != 3 ||
      end != '\n' || pid <= 0 || memfd < 0) {
    throw Error(ELASTIC_ERR_BAD_FILE,
                "'" + path + "' is not an elasticrun " + what + " (no locator in it)");
  }
  return "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(memfd);
}

}  // namespace

std::unique_ptr<SharedMapping> SharedMapping::create_sealed(const std::string& path, size_t size,
                                                            const char* what) {
  check_path(path, what);
  int fd = ::memfd_create("elasticrun", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) throw system_error(errno, std::string("cannot make the ") + what + "'s memory");
  void* data = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(size)) == 0 &&
      ::fcntl(fd, F_ADD_SEALS, kSeals | F_SEAL_SEAL) == 0) {
    data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (data == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    throw system_error(err, std::string("cannot make the ") + what + "'s sealed memory");
  }
  try {
    write_locator(path, fd, what);
  } catch (...) {
    ::munmap(data, size);
    ::close(fd);
    throw;
  }
  auto mapping = std::unique_ptr<SharedMapping>(new SharedMapping(path, data, size, fd));
  mapping->unlink_on_close();
  return mapping;
}

std::unique_ptr<SharedMapping> SharedMapping::open_sealed(const std::string& path,
                                                          size_t min_size, const char* what) {
  check_path(path, what);
  const std::string segment = read_locator(path, what);
  int fd = ::open(segment.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) {
      throw Error(ELASTIC_ERR_BAD_FILE, std::string("the ") + what + " at '" + path +
                                            "' is gone: its creator has exited");
    }
    throw Error(ELASTIC_ERR_BAD_FILE, "'" + path + "' is not an elasticrun " + what +
                                          " (what it names cannot be opened: " +
                                          std::strerror(err) + ")");
  }
  struct stat st {};
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (static_cast<unsigned>(seals) & kSeals) != kSeals || ::fstat(fd, &st) != 0 ||
      static_cast<size_t>(st.st_size) < min_size) {
    ::close(fd);
    throw Error(ELASTIC_ERR_BAD_FILE, "'" + path + "' is not an elasticrun " + what +
                                          " (what it names is not sealed memory of its size)");
  }
  const auto size = static_cast<size_t>(st.st_size);
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) {
    throw system_error(err, std::string("cannot map the ") + what + " at '" + path + "'");
  }
  return std::unique_ptr<SharedMapping>(new SharedMapping(path, data, size));
}

SharedMapping::~SharedMapping() {
  ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
  if (unlink_) ::unlink(path_.c_str());
}

}  // namespace elastic::detail
