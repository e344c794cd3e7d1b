// elastic/gpu_health.hpp: GPU health checks through NVML, loaded with dlopen at run time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "elastic/error.hpp"

namespace elastic {

/// Result of checking one device.
struct GpuReport {
  int32_t device = -1;
  elastic_gpu_state state = ELASTIC_GPU_UNKNOWN;
  uint32_t faults = 0;  ///< ELASTIC_GPU_FAULT_* bits
  uint32_t last_xid = 0;
  uint64_t ecc_uncorrected = 0;
  uint64_t time_ns = 0;
  std::string detail;
};

/// Describe fault bits, for example "lost, xid".
std::string gpu_fault_names(uint32_t faults);

/// NVML, loaded at run time. Every NVML call runs on one helper thread and is awaited with a
/// deadline: a call that never returns makes the answer UNKNOWN, never blocks the caller. A
/// missing library is not an error: the state is NOT_AVAILABLE.
class GpuHealth {
 public:
  /// Load `library` (empty: $ELASTIC_NVML_LIBRARY, else "libnvidia-ml.so.1") and initialise NVML,
  /// waiting at most `timeout_ms` for it.
  static std::shared_ptr<GpuHealth> open(const std::string& library = "", int timeout_ms = 2000);
  ~GpuHealth();
  GpuHealth(const GpuHealth&) = delete;
  GpuHealth& operator=(const GpuHealth&) = delete;

  /// HEALTHY (NVML usable), NOT_AVAILABLE or UNKNOWN (initialisation failed or still stuck).
  elastic_gpu_state state() const;
  std::string detail() const;
  std::string library_path() const;
  uint32_t device_count() const;

  /// Check one device, at most `timeout_ms`.
  GpuReport check(uint32_t device, int timeout_ms);
  /// Check every device, at most `timeout_ms` in all.
  std::vector<GpuReport> check_all(int timeout_ms);

  struct Impl;

 private:
  explicit GpuHealth(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace elastic
