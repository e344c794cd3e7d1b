// elastic/watchdog.hpp: a thread that watches worker processes for death (pidfd), hangs (stale
// heartbeats) and GPU faults (NVML), and reports each finding as an Event.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <sys/types.h>

#include "elastic/error.hpp"

namespace elastic {

class HeartbeatTable;
class GpuHealth;
class LocalBarrier;

/// One finding (see elastic_event).
struct Event {
  int32_t worker = -1;
  elastic_event_kind kind = ELASTIC_EVENT_EXITED;
  uint64_t time_ns = 0;
  int32_t pid = 0;
  int32_t exit_code = -1;
  int32_t signal = 0;
  int32_t gpu = -1;
  uint64_t step = 0;
  std::string detail;
};

/// Watchdog settings (see elastic_watchdog_options for their meaning).
struct WatchdogOptions {
  uint64_t default_hang_timeout_ms = 0;
  uint32_t hang_check_interval_ms = 0;  // 0: automatic, a tenth of the smallest timeout
  elastic_death_detection death_detection = ELASTIC_DEATH_AUTO;
  uint32_t poll_interval_ms = 5;
  bool reap = false;
  uint32_t gpu_check_interval_ms = 0;
  int32_t gpu_check_timeout_ms = 2000;
  uint32_t queue_capacity = 1024;
};

/// Receive `sig` when the parent process exits (PR_SET_PDEATHSIG). Throws ELASTIC_ERR_NOT_FOUND
/// if `expected_parent` > 0 and the parent is already another process.
void die_with_parent(int sig, pid_t expected_parent);

class Watchdog {
 public:
  using Callback = std::function<void(const Event&)>;

  explicit Watchdog(const WatchdogOptions& options = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Replace the callback (empty to remove); it runs on the watchdog thread. Returns once no call
  /// of the previous callback is in progress, so it must not be called from the callback.
  void set_callback(Callback callback);

  /// Watch `pid` as worker `worker` (>= 0, unique). `table`/`slot` enable hang checks (slot < 0:
  /// none); `hang_timeout_ms` 0 defers to the worker's own timeout, then the default. `gpu` is
  /// the device the worker uses, -1 none. The table must outlive the watch.
  void watch(int32_t worker, pid_t pid, const HeartbeatTable* table = nullptr, int32_t slot = -1,
             uint64_t hang_timeout_ms = 0, int32_t gpu = -1);
  /// Change a watched worker's hang timeout (the one given to watch()); false if not watched.
  bool set_hang_timeout(int32_t worker, uint64_t hang_timeout_ms);
  /// Stop watching; false if the worker is not watched.
  bool unwatch(int32_t worker);
  /// Number of watched workers.
  size_t watched() const;

  /// Check GPUs through `gpu` (shared: it stays alive while the watchdog uses it).
  void set_gpu_health(std::shared_ptr<GpuHealth> gpu);
  /// Abort `barrier` naming the worker whenever a watched worker exits or hangs.
  void attach_barrier(LocalBarrier* barrier);

  void start();
  /// Stop and join the threads; idempotent.
  void stop();
  bool running() const;

  /// The oldest queued event, waiting at most `timeout_ms` (negative: until one arrives or the
  /// watchdog stops). nullopt if none came.
  std::optional<Event> next_event(int timeout_ms);
  uint64_t dropped_events() const;
  /// ELASTIC_DEATH_PIDFD or ELASTIC_DEATH_POLL: what start() chose (or will choose).
  elastic_death_detection death_detection() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace elastic
