#include "elastic/heartbeat.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

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

}  // namespace

// ---- HeartbeatTable -------------------------------------------------------------------------

namespace detail {

// The supervisor's side of a table: a descriptor, never a mapping (see heartbeat.hpp). The slot
// count used for every bound is this private copy; the file's header is the workers' to break.
struct TableFile {
  std::string path;
  uint32_t capacity = 0;
  bool owner = false;
  int fd = -1;
  uint64_t generation = 0;  // the owner's count; rewritten into the header by reset()
  mutable std::mutex m;     // fd: reset() may replace it while the watchdog reads

  ~TableFile() {
    if (fd >= 0) ::close(fd);
    if (owner) ::unlink(path.c_str());
  }
};

}  // namespace detail

namespace {

using detail::TableFile;
using detail::system_error;

// A beat stamped later than this after the reader's clock was not made by beat().
constexpr uint64_t kFutureSlackNs = 1000000000ull;

Error bad_file(const TableFile& f, const std::string& what) {
  return Error(ELASTIC_ERR_BAD_FILE, "heartbeat table '" + f.path + "' " + what);
}

// Read exactly `size` bytes at `offset`; a short read means the file was cut below it.
void pread_exact(const TableFile& f, void* buf, size_t size, size_t offset) {
  ssize_t got;
  do {
    got = ::pread(f.fd, buf, size, static_cast<off_t>(offset));
  } while (got < 0 && errno == EINTR);
  if (got < 0) throw system_error(errno, "cannot read heartbeat table '" + f.path + "'");
  if (static_cast<size_t>(got) != size) {
    struct stat st {};
    const long long now = ::fstat(f.fd, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
    throw bad_file(f, "was truncated to " + std::to_string(now) + " bytes (a table of " +
                          std::to_string(f.capacity) + " slots has " +
                          std::to_string(detail::table_size(f.capacity)) + ")");
  }
}

void pwrite_exact(const TableFile& f, const void* buf, size_t size, size_t offset) {
  const char* p = static_cast<const char*>(buf);
  while (size > 0) {
    ssize_t put = ::pwrite(f.fd, p, size, static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) throw system_error(errno, "cannot write heartbeat table '" + f.path + "'");
    p += put;
    size -= static_cast<size_t>(put);
    offset += static_cast<size_t>(put);
  }
}

// The whole file as its creator writes it: the header, then `capacity` empty slots.
void write_fresh(const TableFile& f) {
  std::vector<char> bytes(detail::table_size(f.capacity), 0);
  auto* h = reinterpret_cast<TableHeader*>(bytes.data());
  h->version = detail::kTableVersion;
  h->capacity = f.capacity;
  h->header_size = sizeof(TableHeader);
  h->slot_size = sizeof(Slot);
  h->creator_pid = static_cast<int32_t>(::getpid());
  h->created_ns = now_ns();
  h->generation.store(f.generation, std::memory_order_relaxed);
  h->magic.store(detail::kTableMagic, std::memory_order_relaxed);
  if (::ftruncate(f.fd, static_cast<off_t>(bytes.size())) != 0) {
    throw system_error(errno, "cannot size heartbeat table '" + f.path + "' (is the file "
                                  "system full?)");
  }
  pwrite_exact(f, bytes.data(), bytes.size(), 0);
}

// The header as the reader expects it; any other is a table a worker overwrote.
void check_header(const TableFile& f, const TableHeader& h) {
  if (h.magic.load(std::memory_order_relaxed) != detail::kTableMagic ||
      h.version != detail::kTableVersion || h.header_size != sizeof(TableHeader) ||
      h.slot_size != sizeof(Slot) || h.capacity != f.capacity) {
    throw bad_file(f, "has a header that is not the one its creator wrote: the file was "
                      "overwritten");
  }
}

// A slot read until two reads agree: pread copies bytes, and a beat may land between them.
void read_stable(const TableFile& f, Slot& out, size_t offset) {
  alignas(Slot) unsigned char again[sizeof(Slot)];
  pread_exact(f, &out, sizeof(Slot), offset);
  for (int i = 0; i < 4; ++i) {
    pread_exact(f, again, sizeof(Slot), offset);
    if (std::memcmp(again, &out, sizeof(Slot)) == 0) return;
    std::memcpy(static_cast<void*>(&out), again, sizeof(Slot));
  }
}

// True if the path still names the file behind `fd`.
bool same_file(const TableFile& f) {
  struct stat a {}, b {};
  return ::fstat(f.fd, &a) == 0 && ::stat(f.path.c_str(), &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

}  // namespace

HeartbeatTable::HeartbeatTable(std::unique_ptr<detail::TableFile> file) : file_(std::move(file)) {}

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
  detail::check_path(path, kWhat);
  auto f = std::make_unique<TableFile>();
  f->path = path;
  f->capacity = slots;
  f->fd = detail::create_exclusive(path, O_RDWR, kWhat);
  f->owner = true;  // from here the file is removed on every exit path
  write_fresh(*f);
  return HeartbeatTable(std::move(f));
}

HeartbeatTable HeartbeatTable::open(const std::string& path) {
  auto mapping = detail::SharedMapping::open(path, sizeof(TableHeader), kWhat);
  auto f = std::make_unique<TableFile>();
  f->path = path;
  f->capacity = validate(*mapping);
  f->generation =
      static_cast<TableHeader*>(mapping->data())->generation.load(std::memory_order_acquire);
  mapping.reset();
  f->fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f->fd < 0) throw system_error(errno, "cannot open heartbeat table '" + path + "'");
  return HeartbeatTable(std::move(f));
}

uint32_t HeartbeatTable::capacity() const noexcept { return file_->capacity; }

uint64_t HeartbeatTable::generation() const noexcept {
  std::lock_guard<std::mutex> g(file_->m);
  TableHeader h;
  try {
    pread_exact(*file_, &h, sizeof h, 0);
    check_header(*file_, h);
    return h.generation.load(std::memory_order_relaxed);
  } catch (const Error&) {
    return file_->generation;  // a broken header: the count this handle last wrote or read
  }
}

const std::string& HeartbeatTable::path() const noexcept { return file_->path; }
bool HeartbeatTable::owner() const noexcept { return file_->owner; }

void HeartbeatTable::check_slot(uint32_t slot) const {
  if (slot >= file_->capacity) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "slot " + std::to_string(slot) + " is out of range: heartbeat table '" + path() +
                    "' has " + std::to_string(file_->capacity) + " slots (0.." +
                    std::to_string(file_->capacity - 1) + ")");
  }
}

SlotInfo HeartbeatTable::read(uint32_t slot) const {
  check_slot(slot);
  const TableFile& f = *file_;
  TableHeader h;
  Slot s;
  {
    std::lock_guard<std::mutex> g(f.m);
    pread_exact(f, &h, sizeof h, 0);
    check_header(f, h);
    read_stable(f, s, sizeof(TableHeader) + static_cast<size_t>(slot) * sizeof(Slot));
  }
  SlotInfo info{};
  info.last_beat_ns = s.last_beat_ns.load(std::memory_order_relaxed);
  info.step = s.step.load(std::memory_order_relaxed);
  info.pid = s.pid.load(std::memory_order_relaxed);
  info.timeout_ms = s.timeout_ms.load(std::memory_order_relaxed);
  info.state = s.state.load(std::memory_order_relaxed);
  if (info.last_beat_ns > now_ns() + kFutureSlackNs) {
    throw bad_file(f, "slot " + std::to_string(slot) + " holds a beat time " +
                          std::to_string((info.last_beat_ns - now_ns()) / 1000000) +
                          " ms in the future: it was not written by beat()");
  }
  if (info.timeout_ms > ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS) {
    throw bad_file(f, "slot " + std::to_string(slot) + " asks for a hang timeout of " +
                          std::to_string(info.timeout_ms) + " ms, longer than the " +
                          std::to_string(ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS) +
                          " ms a worker may set");
  }
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

void HeartbeatTable::reset_slot(uint32_t slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> g(file_->m);
  const Slot empty{};
  pwrite_exact(*file_, &empty, sizeof empty,
               sizeof(TableHeader) + static_cast<size_t>(slot) * sizeof(Slot));
}

void HeartbeatTable::reset() {
  TableFile& f = *file_;
  std::lock_guard<std::mutex> g(f.m);
  f.generation += 1;
  if (f.owner && !same_file(f)) {
    // The path was unlinked or now names another file: put a table of ours back at it.
    ::unlink(f.path.c_str());
    int fd = detail::create_exclusive(f.path, O_RDWR, kWhat);
    ::close(f.fd);
    f.fd = fd;
  }
  write_fresh(f);
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
  if (timeout_ms > ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS) timeout_ms = ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS;
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
