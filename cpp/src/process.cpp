#include "process.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "elastic/error.hpp"
#include "util.hpp"

#ifndef P_PIDFD
#define P_PIDFD 3
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace elastic {

void die_with_parent(int sig, pid_t expected_parent) {
  if (sig <= 0 || sig >= NSIG) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "signal " + std::to_string(sig) + " is not a signal number");
  }
  if (::prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0) {
    throw detail::system_error(errno, "prctl(PR_SET_PDEATHSIG)");
  }
  // The parent may have died before the call: then the signal will never come.
  if (expected_parent > 0 && ::getppid() != expected_parent) {
    throw Error(ELASTIC_ERR_NOT_FOUND, "the parent process " + std::to_string(expected_parent) +
                                           " has already exited");
  }
}

}  // namespace elastic

namespace elastic::detail {

int pidfd_open(pid_t pid) noexcept {
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
}

bool pidfds_supported() noexcept {
  int fd = pidfd_open(::getpid());
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

bool is_child(pid_t pid) noexcept {
  siginfo_t si{};
  return ::waitid(P_PID, static_cast<id_t>(pid), &si, WEXITED | WNOHANG | WNOWAIT) == 0;
}

namespace {

// A process that is not our child: gone if kill() says so, or a zombie per /proc.
bool foreign_process_ended(pid_t pid) noexcept {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* close_paren = std::strrchr(buf, ')');  // the command name may contain spaces
  return close_paren != nullptr && close_paren[1] == ' ' &&
         (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

}  // namespace

ExitStatus probe_exit(pid_t pid, int pidfd, bool child, bool reap) noexcept {
  ExitStatus st;
  if (!child) {
    if (pidfd >= 0) {
      st.exited = true;  // the caller saw the pidfd become readable
    } else {
      st.exited = foreign_process_ended(pid);
    }
    return st;
  }
  siginfo_t si{};
  int flags = WEXITED | WNOHANG | (reap ? 0 : WNOWAIT);
  int rc = -1;
  if (pidfd >= 0) {
    rc = ::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(pidfd), &si, flags);
    if (rc != 0 && errno == EINVAL) pidfd = -1;  // kernel 5.3: pidfd_open but no P_PIDFD
  }
  if (pidfd < 0) rc = ::waitid(P_PID, static_cast<id_t>(pid), &si, flags);
  if (rc != 0) {
    // ECHILD: someone else reaped it (the owner, racing us): it has ended, status unknown.
    st.exited = errno == ECHILD;
    return st;
  }
  if (si.si_pid == 0) return st;  // still running
  st.exited = true;
  st.known = true;
  if (si.si_code == CLD_EXITED) {
    st.exit_code = si.si_status;
  } else {
    st.signal = si.si_status;
    st.core_dumped = si.si_code == CLD_DUMPED;
  }
  return st;
}

std::string describe_exit(const ExitStatus& st) {
  if (!st.known) return "exited (not a child of the watchdog's process, so its status is unknown)";
  if (st.signal != 0) {
    return std::string(st.core_dumped ? "dumped core on " : "was killed by ") +
           signal_name(st.signal) + " (signal " + std::to_string(st.signal) + ")";
  }
  return "exited with code " + std::to_string(st.exit_code);
}

}  // namespace elastic::detail
