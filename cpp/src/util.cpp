#include "util.hpp"

#include <csignal>
#include <cstring>
#include <ctime>

namespace elastic {

uint64_t now_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // vDSO: no system call on common clock sources
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

namespace detail {

Error system_error(int err, const std::string& what) {
  return Error(ELASTIC_ERR_SYSTEM, what + ": " + std::strerror(err) + " (errno " +
                                       std::to_string(err) + ")");
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  if (abbrev != nullptr) return std::string("SIG") + abbrev;
  return "signal " + std::to_string(sig);
}

void copy_string(char* dst, size_t capacity, const std::string& src) noexcept {
  if (capacity == 0) return;
  size_t n = src.size() < capacity - 1 ? src.size() : capacity - 1;
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

uint64_t deadline_after_ms(int timeout_ms) noexcept {
  if (timeout_ms < 0) return UINT64_MAX;
  return now_ns() + static_cast<uint64_t>(timeout_ms) * 1000000ull;
}

}  // namespace detail
}  // namespace elastic
