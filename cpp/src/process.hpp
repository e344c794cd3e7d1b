// Internal: process primitives for the watchdog (pidfd with a fallback).
#pragma once

#include <sys/types.h>

#include <string>

namespace elastic::detail {

/// pidfd_open(2); -1 with errno on failure (ENOSYS on kernels before 5.3).
int pidfd_open(pid_t pid) noexcept;

/// True if this kernel supports pidfd_open.
bool pidfds_supported() noexcept;

/// How a process ended, as far as it can be known.
struct ExitStatus {
  bool known = false;
  bool exited = false;  // the process is gone (or a zombie)
  int exit_code = -1;   // set if it exited normally
  int signal = 0;       // set if a signal ended it
  bool core_dumped = false;
};

/// Whether `pid` (with `pidfd` if >= 0) has ended, without blocking. For a child of this process
/// the status is read too; `reap` collects it, otherwise it is left for the owner (WNOWAIT).
/// For other processes only the fact of the exit is known.
ExitStatus probe_exit(pid_t pid, int pidfd, bool is_child, bool reap) noexcept;

/// True if `pid` is a child of this process.
bool is_child(pid_t pid) noexcept;

/// "exited with code 1", "was killed by SIGKILL (signal 9)", ...
std::string describe_exit(const ExitStatus& status);

}  // namespace elastic::detail
