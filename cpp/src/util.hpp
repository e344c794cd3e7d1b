// Internal helpers shared by the implementation files.
#pragma once

#include <cstdint>
#include <string>

#include "elastic/error.hpp"

namespace elastic::detail {

/// An Error for a failed system call: `what` plus strerror(err).
Error system_error(int err, const std::string& what);

/// "SIGKILL" for 9; "signal 77" for numbers without a name.
std::string signal_name(int sig);

/// Copy a string into a fixed C buffer, always NUL-terminated.
void copy_string(char* dst, size_t capacity, const std::string& src) noexcept;

/// Convert a millisecond timeout (negative = none) into an absolute deadline, UINT64_MAX for none.
uint64_t deadline_after_ms(int timeout_ms) noexcept;

/// Spin-wait hint for the CPU.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace elastic::detail
