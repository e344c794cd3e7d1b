// The shared-memory barrier. A 32-bit word holds the round number (31 bits) and an ABORTED bit;
// waiters sleep on it with a futex, so both a completed round and an abort change the word they
// sleep on and no wake-up can be lost. (A round counter is the sense of a sense-reversing
// barrier, widened so that no two consecutive rounds look alike.)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <atomic>
#include <climits>
#include <cstring>
#include <ctime>

#include "elastic/barrier.hpp"
#include "shared_mapping.hpp"
#include "util.hpp"

namespace elastic {
namespace detail {

constexpr uint64_t kBarrierMagic = 0x3152414245454c00ull;  // "\0ELEBAR1"
constexpr uint32_t kBarrierVersion = 1;
constexpr uint32_t kAbortBit = 0x80000000u;
constexpr uint32_t kRoundMask = 0x7fffffffu;
constexpr uint32_t kMaxParties = 4096;

struct alignas(64) BarrierHeader {
  std::atomic<uint64_t> magic;
  uint32_t version;
  uint32_t parties;
  uint32_t header_size;
  uint32_t participant_size;
  std::atomic<uint64_t> rounds;
  alignas(64) std::atomic<uint32_t> word;     // round | kAbortBit; the futex word
  alignas(64) std::atomic<uint32_t> arrived;  // arrivals in the current round
  alignas(64) std::atomic<uint32_t> abort_claimed;
  int32_t abort_participant;
  char abort_reason[244];
};

struct alignas(64) Participant {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> arrived_round;  // (round + 1) of the last round it arrived in
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex word must be lock-free");

inline Participant* participants(BarrierHeader* h) {
  return reinterpret_cast<Participant*>(reinterpret_cast<char*>(h) + sizeof(BarrierHeader));
}

inline size_t barrier_size(uint32_t parties) {
  return sizeof(BarrierHeader) + parties * sizeof(Participant);
}

// FUTEX_WAIT without FUTEX_PRIVATE_FLAG: the word is shared between processes.
long futex_wait(std::atomic<uint32_t>* word, uint32_t expected, uint64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000ull),
              static_cast<long>(timeout_ns % 1000000000ull)};
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr,
                 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace detail

using detail::BarrierHeader;
using detail::kAbortBit;
using detail::kRoundMask;

namespace {
constexpr const char* kWhat = "barrier";
constexpr uint64_t kSpinNs = 20000;    // busy-wait this long before yielding the core
constexpr uint64_t kYieldNs = 200000;  // then yield until this long before sleeping

// Returns the party count, read once: the header is shared memory that can change under us.
uint32_t validate(detail::SharedMapping& m) {
  auto* h = static_cast<BarrierHeader*>(m.data());
  if (h->magic.load(std::memory_order_acquire) != detail::kBarrierMagic) {
    throw Error(ELASTIC_ERR_BAD_FILE, "'" + m.path() +
                                          "' is not an elasticrun barrier (wrong magic number)");
  }
  if (h->version != detail::kBarrierVersion || h->header_size != sizeof(BarrierHeader) ||
      h->participant_size != sizeof(detail::Participant)) {
    throw Error(ELASTIC_ERR_BAD_FILE,
                "barrier '" + m.path() + "' has layout version " + std::to_string(h->version) +
                    ", this library reads version " + std::to_string(detail::kBarrierVersion) +
                    ": use the same elasticrun version everywhere");
  }
  const uint32_t parties = h->parties;
  if (parties == 0 || parties > detail::kMaxParties || m.size() < detail::barrier_size(parties)) {
    throw Error(ELASTIC_ERR_BAD_FILE, "barrier '" + m.path() + "' is truncated");
  }
  return parties;
}
}  // namespace

LocalBarrier::LocalBarrier(std::unique_ptr<detail::SharedMapping> mapping, uint32_t parties,
                           int32_t index)
    : mapping_(std::move(mapping)),
      header_(static_cast<BarrierHeader*>(mapping_->data())),
      parties_(parties),
      index_(index) {}

LocalBarrier::LocalBarrier(LocalBarrier&&) noexcept = default;
LocalBarrier& LocalBarrier::operator=(LocalBarrier&&) noexcept = default;
LocalBarrier::~LocalBarrier() = default;

LocalBarrier LocalBarrier::create(const std::string& path, uint32_t parties) {
  if (parties == 0 || parties > detail::kMaxParties) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "a barrier needs between 1 and " + std::to_string(detail::kMaxParties) +
                    " parties, got " + std::to_string(parties));
  }
  auto mapping = detail::SharedMapping::create_sealed(path, detail::barrier_size(parties), kWhat);
  auto* h = static_cast<BarrierHeader*>(mapping->data());
  h->version = detail::kBarrierVersion;
  h->parties = parties;
  h->header_size = sizeof(BarrierHeader);
  h->participant_size = sizeof(detail::Participant);
  h->abort_participant = -1;
  h->magic.store(detail::kBarrierMagic, std::memory_order_release);
  return LocalBarrier(std::move(mapping), parties, -1);
}

LocalBarrier LocalBarrier::open(const std::string& path, uint32_t index) {
  auto mapping = detail::SharedMapping::open_sealed(path, sizeof(BarrierHeader), kWhat);
  const uint32_t parties = validate(*mapping);
  auto* h = static_cast<BarrierHeader*>(mapping->data());
  if (index >= parties) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "participant " + std::to_string(index) + " is out of range: barrier '" + path +
                    "' has " + std::to_string(parties) + " parties (0.." +
                    std::to_string(parties - 1) + ")");
  }
  detail::participants(h)[index].pid.store(static_cast<int32_t>(::getpid()),
                                           std::memory_order_relaxed);
  return LocalBarrier(std::move(mapping), parties, static_cast<int32_t>(index));
}

uint32_t LocalBarrier::parties() const noexcept { return parties_; }
uint64_t LocalBarrier::rounds() const noexcept {
  return header_->rounds.load(std::memory_order_acquire);
}
bool LocalBarrier::aborted() const noexcept {
  return (header_->word.load(std::memory_order_acquire) & kAbortBit) != 0;
}
const std::string& LocalBarrier::path() const noexcept { return mapping_->path(); }

void LocalBarrier::throw_aborted() const {
  // The reason is shared memory: read at most its buffer, whether or not it ends in a NUL.
  const char* reason = header_->abort_reason;
  std::string text(reason, ::strnlen(reason, sizeof(header_->abort_reason)));
  int32_t culprit = header_->abort_participant;
  if (culprit < -1 || culprit >= static_cast<int32_t>(parties_)) culprit = -1;
  throw Error(ELASTIC_ERR_ABORTED, std::string("barrier '") + path() + "' was aborted: " + text +
                                       " (reset the barrier before using it again)")
      .with_culprit(culprit);
}

void LocalBarrier::abort(int32_t participant, const std::string& reason) noexcept {
  uint32_t expected = 0;
  if (header_->abort_claimed.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    header_->abort_participant = participant;
    std::memset(header_->abort_reason, 0, sizeof(header_->abort_reason));
    detail::copy_string(header_->abort_reason, sizeof(header_->abort_reason), reason);
    header_->word.fetch_or(kAbortBit, std::memory_order_release);
  }
  detail::futex_wake_all(&header_->word);
}

void LocalBarrier::reset() noexcept {
  header_->arrived.store(0, std::memory_order_relaxed);
  header_->abort_participant = -1;
  std::memset(header_->abort_reason, 0, sizeof(header_->abort_reason));
  header_->abort_claimed.store(0, std::memory_order_relaxed);
  header_->word.fetch_and(kRoundMask, std::memory_order_release);
}

void LocalBarrier::wait(int timeout_ms) {
  if (index_ < 0) {
    throw Error(ELASTIC_ERR_STATE, "the barrier's creator is not a participant: open the barrier "
                                   "with a participant index to wait on it");
  }
  const uint64_t deadline = detail::deadline_after_ms(timeout_ms);
  uint32_t word = header_->word.load(std::memory_order_acquire);
  if (word & kAbortBit) throw_aborted();
  const uint32_t round = word & kRoundMask;
  const uint32_t next = (round + 1) & kRoundMask;
  detail::participants(header_)[index_].arrived_round.store(round + 1, std::memory_order_relaxed);

  if (header_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == parties_) {
    // Last to arrive: open the next round unless an abort got there first.
    header_->arrived.store(0, std::memory_order_relaxed);
    header_->rounds.fetch_add(1, std::memory_order_relaxed);
    uint32_t expected = round;
    bool opened = header_->word.compare_exchange_strong(expected, next, std::memory_order_acq_rel);
    detail::futex_wake_all(&header_->word);
    if (!opened) throw_aborted();
    return;
  }
  if (!await_round(round, deadline)) time_out(round, timeout_ms);
}

bool LocalBarrier::await_round(uint32_t round, uint64_t deadline) {
  // Spin first: on an idle core a round usually completes within microseconds. Then yield, in
  // case the cores are oversubscribed, and finally sleep on the futex.
  // With more participants than cores, spinning only delays the ones still to arrive: yield.
  static const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const uint64_t spin_ns = parties_ > static_cast<uint32_t>(cores) ? 0 : kSpinNs;
  const uint64_t start = now_ns();
  uint32_t word = 0;
  for (uint32_t i = 1;; ++i) {
    word = header_->word.load(std::memory_order_acquire);
    if ((word & kRoundMask) != round) return true;  // completed (even if aborted right after)
    if (word & kAbortBit) throw_aborted();
    if ((i & 31u) == 0) {
      uint64_t spent = now_ns() - start;
      if (spent > kYieldNs || now_ns() >= deadline) break;
      if (spent >= spin_ns) sched_yield();
    }
    detail::cpu_relax();
  }
  for (;;) {
    uint64_t now = now_ns();
    if (now >= deadline) return false;
    detail::futex_wait(&header_->word, word, deadline - now);
    word = header_->word.load(std::memory_order_acquire);
    if ((word & kRoundMask) != round) return true;
    if (word & kAbortBit) throw_aborted();
  }
}

void LocalBarrier::time_out(uint32_t round, int timeout_ms) {
  // Out of time: name who has not arrived, and break the barrier so that nobody waits for them.
  std::string missing;
  int32_t first_missing = -1;
  auto* parts = detail::participants(header_);
  for (uint32_t i = 0; i < parties_; ++i) {
    if (parts[i].arrived_round.load(std::memory_order_relaxed) != round + 1) {
      if (first_missing < 0) first_missing = static_cast<int32_t>(i);
      if (!missing.empty()) missing += ", ";
      missing += std::to_string(i);
      int32_t pid = parts[i].pid.load(std::memory_order_relaxed);
      if (pid > 0) missing += " (pid " + std::to_string(pid) + ")";
    }
  }
  uint32_t word = header_->word.load(std::memory_order_acquire);
  if ((word & kRoundMask) != round) return;  // completed at the last moment
  if (word & kAbortBit) throw_aborted();      // someone else broke it first
  std::string reason = "participant(s) " + missing + " did not arrive within " +
                       std::to_string(timeout_ms) + " ms (noticed by participant " +
                       std::to_string(index_) + ")";
  abort(first_missing, reason);
  throw Error(ELASTIC_ERR_TIMEOUT, "barrier '" + path() + "' timed out: " + reason)
      .with_culprit(first_missing);
}

}  // namespace elastic
