// elastic/barrier.hpp: a shared-memory barrier among the processes of one node, and a TCP
// barrier among node leaders.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "elastic/error.hpp"

namespace elastic {

namespace detail {
struct BarrierHeader;
class SharedMapping;
}  // namespace detail

/// A reusable barrier for a fixed number of processes. Waiters spin briefly, then sleep on a futex.
/// A timeout or an abort breaks the barrier for everyone until reset(), and the error names the
/// participant at fault (Error::culprit()).
class LocalBarrier {
 public:
  /// Create the barrier file for `parties` participants. The creator is not a participant; it
  /// removes the file when destroyed.
  static LocalBarrier create(const std::string& path, uint32_t parties);
  /// Join as participant `index` (records this pid for error messages).
  static LocalBarrier open(const std::string& path, uint32_t index);

  LocalBarrier(LocalBarrier&&) noexcept;
  LocalBarrier& operator=(LocalBarrier&&) noexcept;
  ~LocalBarrier();

  /// Wait for every participant, at most `timeout_ms` (negative: no limit). Only participants
  /// (made by open()) may wait.
  void wait(int timeout_ms);
  /// Break the barrier: every waiter, now and later, gets ELASTIC_ERR_ABORTED naming
  /// `participant`. The first abort wins; later ones are ignored.
  void abort(int32_t participant, const std::string& reason) noexcept;
  /// Make a broken barrier usable again; only when nobody is waiting.
  void reset() noexcept;

  uint32_t parties() const noexcept;
  uint64_t rounds() const noexcept;
  bool aborted() const noexcept;
  /// -1 for the creator.
  int32_t index() const noexcept { return index_; }
  const std::string& path() const noexcept;

 private:
  LocalBarrier(std::unique_ptr<detail::SharedMapping> mapping, uint32_t parties, int32_t index);
  [[noreturn]] void throw_aborted() const;
  // wait()'s steps: until the round completes (false: the deadline came first), and then the
  // timeout that names who did not arrive and breaks the barrier.
  bool await_round(uint32_t round, uint64_t deadline);
  void time_out(uint32_t round, int timeout_ms);

  std::unique_ptr<detail::SharedMapping> mapping_;
  detail::BarrierHeader* header_ = nullptr;
  // Validated once: the header is shared memory any participant can overwrite, so bounds use
  // this private copy, never the shared field.
  uint32_t parties_ = 0;
  int32_t index_ = -1;
};

/// A barrier among node leaders over TCP. Rank 0 listens at peers[0]; the others connect to it.
class TcpBarrier {
 public:
  /// `peers` are "host:port" (or "[v6addr]:port"), one per rank. Rank 0 binds its own entry and
  /// waits up to `connect_timeout_ms` for every other rank; the others retry connecting to rank
  /// 0 for as long. `token` must match on every peer: each joining peer and rank 0 prove to
  /// each other that they hold it (an HMAC challenge over fresh nonces; the token is never
  /// sent), and rank 0 handshakes with every connecting peer at once.
  TcpBarrier(std::vector<std::string> peers, uint32_t rank, const std::string& token,
             int connect_timeout_ms);
  ~TcpBarrier();
  TcpBarrier(const TcpBarrier&) = delete;
  TcpBarrier& operator=(const TcpBarrier&) = delete;

  /// One round, at most `timeout_ms` (negative: no limit). A peer that fails is named.
  void wait(int timeout_ms);

  uint32_t rank() const noexcept { return rank_; }
  uint32_t size() const noexcept { return static_cast<uint32_t>(peers_.size()); }
  uint64_t rounds() const noexcept { return round_; }
  /// The port rank 0 listens on (useful when its peer entry used port 0); 0 for other ranks.
  uint16_t bound_port() const noexcept { return bound_port_; }

 private:
  // The constructor's steps: rank 0 listens and admits every member; the others connect.
  void listen_on_own_entry();
  void accept_members(uint64_t deadline, int connect_timeout_ms);
  void join_leader(uint64_t deadline, int connect_timeout_ms);
  int connect_to_leader(uint64_t deadline, int connect_timeout_ms);
  bool handshake(int fd, uint64_t deadline);
  void wait_leader(uint64_t deadline);
  void wait_member(uint64_t deadline);
  std::string describe(uint32_t rank) const;
  void close_all() noexcept;

  std::vector<std::string> peers_;
  uint32_t rank_;
  std::string token_;  // the key of the handshake's HMAC challenge; never sent
  uint64_t round_ = 0;
  uint16_t bound_port_ = 0;
  int listen_fd_ = -1;
  std::vector<int> fds_;  // leader: one per rank (own entry -1); member: [0] = leader
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace elastic
