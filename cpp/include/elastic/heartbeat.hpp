// elastic/heartbeat.hpp: the shared-memory heartbeat table (supervisor side) and a worker's
// heartbeat (worker side).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "elastic/error.hpp"

namespace elastic {

namespace detail {
struct Slot;
struct TableFile;
class SharedMapping;
}  // namespace detail

/// A snapshot of one slot (see elastic_slot_info).
using SlotInfo = elastic_slot_info;

/// The table a supervisor creates before it starts its workers. Move-only; the creating instance
/// removes the file when destroyed.
///
/// The supervisor never maps the file: workers can write it, truncate it, replace it, so every
/// read goes through pread() on a descriptor it holds and is checked (a short file, a header that
/// changed, a beat time in the future, a timeout above ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS are
/// errors naming what was wrong, never a SIGBUS). reset() and reset_slot() rewrite what they
/// touch, and reset() makes a new file should the path no longer name this table's.
class HeartbeatTable {
 public:
  /// Create the file at `path` with `slots` empty slots (fails if it exists).
  static HeartbeatTable create(const std::string& path, uint32_t slots);
  /// Open an existing table (validated like a worker's attach).
  static HeartbeatTable open(const std::string& path);

  HeartbeatTable(HeartbeatTable&&) noexcept;
  HeartbeatTable& operator=(HeartbeatTable&&) noexcept;
  ~HeartbeatTable();

  uint32_t capacity() const noexcept;
  uint64_t generation() const noexcept;
  const std::string& path() const noexcept;
  bool owner() const noexcept;

  /// A snapshot of `slot`; ELASTIC_ERR_BAD_FILE if the file no longer holds a valid one.
  SlotInfo read(uint32_t slot) const;
  void reset_slot(uint32_t slot);
  /// Rewrite the header, empty every slot and bump the generation.
  void reset();

 private:
  explicit HeartbeatTable(std::unique_ptr<detail::TableFile> file);
  void check_slot(uint32_t slot) const;

  std::unique_ptr<detail::TableFile> file_;
};

/// A worker's handle on its own slot. beat() is a pair of atomic stores: no lock, no system call.
class Heartbeat {
 public:
  /// Attach to slot `slot` of the table at `path`: records this process's pid in the slot.
  static Heartbeat attach(const std::string& path, uint32_t slot);
  /// Attach from ELASTIC_HEARTBEAT_FILE / ELASTIC_HEARTBEAT_SLOT; nullopt when they are unset.
  /// Set but invalid values are an error.
  static std::optional<Heartbeat> from_env();

  Heartbeat(Heartbeat&&) noexcept;
  Heartbeat& operator=(Heartbeat&&) noexcept;
  ~Heartbeat();

  /// Advance the step counter by one and record the time.
  void beat() noexcept { beat(step_ + 1); }
  /// Record `step` and the time.
  void beat(uint64_t step) noexcept;
  /// The worker's own hang timeout (0: leave it to the supervisor).
  void set_timeout_ms(uint64_t timeout_ms) noexcept;
  /// The worker's own hang timeout as last set (0: none).
  uint64_t timeout_ms() const noexcept;
  uint32_t slot() const noexcept { return index_; }
  uint64_t step() const noexcept { return step_; }
  /// Mark the slot detached (a clean finish) and unmap; also done by the destructor.
  void detach() noexcept;

 private:
  Heartbeat(std::unique_ptr<detail::SharedMapping> mapping, detail::Slot* slot, uint32_t index);

  std::unique_ptr<detail::SharedMapping> mapping_;
  detail::Slot* slot_ = nullptr;
  uint32_t index_ = 0;
  uint64_t step_ = 0;
};

}  // namespace elastic
