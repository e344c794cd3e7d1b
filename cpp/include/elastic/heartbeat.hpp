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
struct TableHeader;
struct Slot;
class SharedMapping;
}  // namespace detail

/// A snapshot of one slot (see elastic_slot_info).
using SlotInfo = elastic_slot_info;

/// The table a supervisor creates before it starts its workers. Move-only; the creating instance
/// removes the file when destroyed.
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

  SlotInfo read(uint32_t slot) const;
  void reset_slot(uint32_t slot);
  /// Empty every slot and bump the generation.
  void reset();

 private:
  HeartbeatTable(std::unique_ptr<detail::SharedMapping> mapping, uint32_t capacity, bool owner);
  detail::Slot& slot_ref(uint32_t slot) const;

  std::unique_ptr<detail::SharedMapping> mapping_;
  detail::TableHeader* header_ = nullptr;
  // Validated once: the header is shared memory a worker can overwrite, so the slot count used
  // for every bound is this private copy, never re-read.
  uint32_t capacity_ = 0;
  bool owner_ = false;
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
