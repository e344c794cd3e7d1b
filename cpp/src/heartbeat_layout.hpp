// Internal: the on-disk layout of the heartbeat table. Any change to it bumps kTableVersion.
#pragma once

#include <atomic>
#include <cstdint>

namespace elastic::detail {

constexpr uint64_t kTableMagic = 0x31544248454c4500ull;  // bytes "\0ELEHBT1": elastic heartbeat table
constexpr uint32_t kTableVersion = 1;
constexpr size_t kCacheLine = 64;

// Written once by the creator; `magic` is stored last (release) so that a reader that sees it
// sees the rest.
struct alignas(kCacheLine) TableHeader {
  std::atomic<uint64_t> magic;
  uint32_t version;
  uint32_t capacity;
  uint32_t header_size;
  uint32_t slot_size;
  int32_t creator_pid;
  uint32_t reserved0;
  uint64_t created_ns;
  std::atomic<uint64_t> generation;
};

// One per worker, on its own cache line so that beats of different workers never share one.
// The worker writes step and last_beat_ns; the supervisor reads them.
struct alignas(kCacheLine) Slot {
  std::atomic<int32_t> pid;
  std::atomic<int32_t> state;  // elastic_slot_state, except BEATING which is derived
  std::atomic<uint64_t> step;
  std::atomic<uint64_t> last_beat_ns;
  std::atomic<uint64_t> timeout_ms;
};

static_assert(sizeof(TableHeader) == kCacheLine, "header must be one cache line");
static_assert(sizeof(Slot) == kCacheLine, "slot must be one cache line");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "64-bit atomics must be lock-free");

inline size_t table_size(uint32_t capacity) {
  return sizeof(TableHeader) + static_cast<size_t>(capacity) * sizeof(Slot);
}

}  // namespace elastic::detail
