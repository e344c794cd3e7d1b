#include "elastic/heartbeat.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "heartbeat_layout.hpp"
#include "shared_mapping.hpp"
#include "util.hpp"

namespace elastic {

using detail::Slot;
using detail::TableHeader;

namespace {

constexpr const char* kWhat = "heartbeat table";

// Validate a mapped file as a heartbeat table; the messages say which check failed. Returns the
// slot count, read once: the header is shared memory that can change under us.
uint32_t validate(detail::SharedMapping& m) {
  auto* h = static_cast<TableHeader*>(m.data());
  const std::string& path = m.path();
  uint64_t magic = h->magic.load(std::memory_order_acquire);
  if (magic != detail::kTableMagic) {
    throw Error(ELASTIC_ERR_BAD_FILE,
                "'" + path + "' is not an elasticrun heartbeat table (wrong magic number): "
                "check ELASTIC_HEARTBEAT_FILE, or that its creator finished writing it");
  }
  if (h->version != detail::kTableVersion) {
    throw Error(ELASTIC_ERR_BAD_FILE,
                "heartbeat table '" + path + "' has layout version " +
                    std::to_string(h->version) + ", this library reads version " +
                    std::to_string(detail::kTableVersion) +
                    ": the launcher and the worker use different elasticrun versions; "
                    "install the same version in both");
  }
  if (h->header_size != sizeof(TableHeader) || h->slot_size != sizeof(Slot)) {
    throw Error(ELASTIC_ERR_BAD_FILE, "heartbeat table '" + path +
                                          "' has an unexpected header or slot size: it was "
                                          "written by an incompatible build");
  }
  const uint32_t capacity = h->capacity;
  if (capacity == 0 || capacity > ELASTIC_HEARTBEAT_MAX_SLOTS ||
      m.size() < detail::table_size(capacity)) {
    throw Error(ELASTIC_ERR_BAD_FILE, "heartbeat table '" + path + "' is truncated: " +
                                          std::to_string(m.size()) + " bytes for " +
                                          std::to_string(capacity) + " slots");
  }
  return capacity;
}

Slot* slot_at(TableHeader* h, uint32_t slot) {
  return reinterpret_cast<Slot*>(reinterpret_cast<char*>(h) + sizeof(TableHeader)) + slot;
}

void clear_slot(Slot& s) {
  s.pid.store(0, std::memory_order_relaxed);
  s.step.store(0, std::memory_order_relaxed);
  s.last_beat_ns.store(0, std::memory_order_relaxed);
  s.timeout_ms.store(0, std::memory_order_relaxed);
  s.state.store(ELASTIC_SLOT_EMPTY, std::memory_order_release);
}

}  // namespace

// ---- HeartbeatTable -------------------------------------------------------------------------

HeartbeatTable::HeartbeatTable(std::unique_ptr<detail::SharedMapping> mapping,
                               uint32_t capacity, bool owner)
    : mapping_(std::move(mapping)),
      header_(static_cast<TableHeader*>(mapping_->data())),
      capacity_(capacity),
      owner_(owner) {}

HeartbeatTable::HeartbeatTable(HeartbeatTable&&) noexcept = default;
HeartbeatTable& HeartbeatTable::operator=(HeartbeatTable&&) noexcept = default;
HeartbeatTable::~HeartbeatTable() = default;

HeartbeatTable HeartbeatTable::create(const std::string& path, uint32_t slots) {
  if (slots == 0 || slots > ELASTIC_HEARTBEAT_MAX_SLOTS) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "heartbeat table needs between 1 and " +
                    std::to_string(ELASTIC_HEARTBEAT_MAX_SLOTS) + " slots, got " +
                    std::to_string(slots));
  }
  auto mapping = detail::SharedMapping::create(path, detail::table_size(slots), kWhat);
  auto* h = static_cast<TableHeader*>(mapping->data());
  h->version = detail::kTableVersion;
  h->capacity = slots;
  h->header_size = sizeof(TableHeader);
  h->slot_size = sizeof(Slot);
  h->creator_pid = static_cast<int32_t>(::getpid());
  h->created_ns = now_ns();
  h->generation.store(0, std::memory_order_relaxed);
  h->magic.store(detail::kTableMagic, std::memory_order_release);
  return HeartbeatTable(std::move(mapping), slots, true);
}

HeartbeatTable HeartbeatTable::open(const std::string& path) {
  auto mapping = detail::SharedMapping::open(path, sizeof(TableHeader), kWhat);
  uint32_t capacity = validate(*mapping);
  return HeartbeatTable(std::move(mapping), capacity, false);
}

uint32_t HeartbeatTable::capacity() const noexcept { return capacity_; }
uint64_t HeartbeatTable::generation() const noexcept {
  return header_->generation.load(std::memory_order_acquire);
}
const std::string& HeartbeatTable::path() const noexcept { return mapping_->path(); }
bool HeartbeatTable::owner() const noexcept { return owner_; }

Slot& HeartbeatTable::slot_ref(uint32_t slot) const {
  if (slot >= capacity_) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "slot " + std::to_string(slot) + " is out of range: heartbeat table '" + path() +
                    "' has " + std::to_string(capacity_) + " slots (0.." +
                    std::to_string(capacity_ - 1) + ")");
  }
  return *slot_at(header_, slot);
}

SlotInfo HeartbeatTable::read(uint32_t slot) const {
  Slot& s = slot_ref(slot);
  SlotInfo info{};
  info.last_beat_ns = s.last_beat_ns.load(std::memory_order_acquire);
  info.step = s.step.load(std::memory_order_relaxed);
  info.pid = s.pid.load(std::memory_order_relaxed);
  info.timeout_ms = s.timeout_ms.load(std::memory_order_relaxed);
  info.state = s.state.load(std::memory_order_acquire);
  // The slot is the worker's to write: a value that is no stored state (BEATING is derived)
  // reads as attached, so the worker stays watched and callers only ever see the enum.
  if (info.state != ELASTIC_SLOT_EMPTY && info.state != ELASTIC_SLOT_DETACHED) {
    info.state = ELASTIC_SLOT_ATTACHED;
  }
  if (info.pid < 0) info.pid = 0;
  if (info.state == ELASTIC_SLOT_ATTACHED && info.last_beat_ns != 0) {
    info.state = ELASTIC_SLOT_BEATING;
  }
  return info;
}

void HeartbeatTable::reset_slot(uint32_t slot) { clear_slot(slot_ref(slot)); }

void HeartbeatTable::reset() {
  for (uint32_t i = 0; i < capacity_; ++i) clear_slot(*slot_at(header_, i));
  header_->generation.fetch_add(1, std::memory_order_acq_rel);
}

// ---- Heartbeat ------------------------------------------------------------------------------

Heartbeat::Heartbeat(std::unique_ptr<detail::SharedMapping> mapping, Slot* slot, uint32_t index)
    : mapping_(std::move(mapping)), slot_(slot), index_(index) {}

Heartbeat::Heartbeat(Heartbeat&& other) noexcept
    : mapping_(std::move(other.mapping_)),
      slot_(other.slot_),
      index_(other.index_),
      step_(other.step_) {
  other.slot_ = nullptr;
}

Heartbeat& Heartbeat::operator=(Heartbeat&& other) noexcept {
  if (this != &other) {
    detach();
    mapping_ = std::move(other.mapping_);
    slot_ = other.slot_;
    index_ = other.index_;
    step_ = other.step_;
    other.slot_ = nullptr;
  }
  return *this;
}

Heartbeat::~Heartbeat() { detach(); }

Heartbeat Heartbeat::attach(const std::string& path, uint32_t slot) {
  auto mapping = detail::SharedMapping::open(path, sizeof(TableHeader), kWhat);
  const uint32_t capacity = validate(*mapping);
  auto* h = static_cast<TableHeader*>(mapping->data());
  if (slot >= capacity) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "heartbeat slot " + std::to_string(slot) + " is out of range: table '" + path +
                    "' has " + std::to_string(capacity) + " slots (0.." +
                    std::to_string(capacity - 1) + ")");
  }
  Slot* s = slot_at(h, slot);
  s->pid.store(static_cast<int32_t>(::getpid()), std::memory_order_relaxed);
  uint64_t step = s->step.load(std::memory_order_relaxed);
  s->state.store(ELASTIC_SLOT_ATTACHED, std::memory_order_release);
  Heartbeat hb(std::move(mapping), s, slot);
  hb.step_ = step;
  return hb;
}

std::optional<Heartbeat> Heartbeat::from_env() {
  const char* file = std::getenv(ELASTIC_ENV_HEARTBEAT_FILE);
  const char* slot = std::getenv(ELASTIC_ENV_HEARTBEAT_SLOT);
  if (file == nullptr || *file == '\0') return std::nullopt;
  if (slot == nullptr || *slot == '\0') {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                std::string(ELASTIC_ENV_HEARTBEAT_FILE) + " is set to '" + file + "' but " +
                    ELASTIC_ENV_HEARTBEAT_SLOT +
                    " is not: set both (the launcher does), or unset both");
  }
  char* end = nullptr;
  errno = 0;
  unsigned long value = std::strtoul(slot, &end, 10);
  if (errno != 0 || end == slot || *end != '\0' || slot[0] == '-' ||
      value >= ELASTIC_HEARTBEAT_MAX_SLOTS) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                std::string(ELASTIC_ENV_HEARTBEAT_SLOT) + "='" + slot +
                    "' is not a slot index: expected an integer from 0 to " +
                    std::to_string(ELASTIC_HEARTBEAT_MAX_SLOTS - 1));
  }
  return attach(file, static_cast<uint32_t>(value));
}

void Heartbeat::beat(uint64_t step) noexcept {
  step_ = step;
  if (slot_ == nullptr) return;
  slot_->step.store(step, std::memory_order_relaxed);
  slot_->last_beat_ns.store(now_ns(), std::memory_order_release);
}

void Heartbeat::set_timeout_ms(uint64_t timeout_ms) noexcept {
  if (slot_ != nullptr) slot_->timeout_ms.store(timeout_ms, std::memory_order_relaxed);
}

uint64_t Heartbeat::timeout_ms() const noexcept {
  return slot_ != nullptr ? slot_->timeout_ms.load(std::memory_order_relaxed) : 0;
}

void Heartbeat::detach() noexcept {
  if (slot_ == nullptr) return;
  slot_->state.store(ELASTIC_SLOT_DETACHED, std::memory_order_release);
  slot_ = nullptr;
  mapping_.reset();
}

}  // namespace elastic
