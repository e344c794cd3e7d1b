// Helpers for the C++ tests: unique shared-memory paths, children that are always ended, and
// counting this process's open file descriptors.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "elastic/error.hpp"

namespace elastic_test {

/// The message of the elastic::Error `fn` throws ("" if none), its status in `status`.
inline std::string error_of(const std::function<void()>& fn, elastic_status* status = nullptr) {
  try {
    fn();
  } catch (const elastic::Error& e) {
    if (status) *status = e.status();
    return e.what();
  }
  return "";
}

/// The sealed memory a barrier's locator file at `path` names ("/proc/PID/fd/FD").
inline std::string segment_of(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  long pid = 0, fd = -1;
  if (f != nullptr) {
    if (std::fscanf(f, "elasticrun-sealed %ld %ld", &pid, &fd) != 2) pid = 0;
    std::fclose(f);
  }
  return "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
}

inline std::string shm_path(const std::string& name) {
  static std::atomic<int> counter{0};
  return "/dev/shm/elastic-test-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter++) + "-" + name;
}

inline int open_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n - 1;  // the DIR's own descriptor
}

inline int thread_count() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

/// A forked child running `body` (then _exit(0)); killed and reaped by the destructor.
class Child {
 public:
  explicit Child(const std::function<void()>& body) {
    pid_ = ::fork();
    if (pid_ == 0) {
      body();
      ::_exit(0);
    }
  }
  ~Child() { end(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  void kill(int sig = SIGKILL) const {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  /// Reap, returning the raw wait status (-1 if already reaped).
  int wait() {
    if (pid_ <= 0) return -1;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  void end() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    wait();
  }

 private:
  pid_t pid_ = -1;
};

/// Poll `pred` every millisecond for at most `ms`; true once it holds.
inline bool eventually(const std::function<bool()>& pred, int ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return pred();
}

inline void write_file(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

}  // namespace elastic_test
