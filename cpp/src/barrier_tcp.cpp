// The TCP barrier among node leaders: a star around rank 0. A round is one ARRIVE from every
// member and one RELEASE back, so it costs two network latencies whatever the size. Frames are a
// fixed little-endian layout. The handshake checks a protocol magic and version, the job size
// and the token, by a mutual HMAC-SHA256 challenge:
//   member -> rank 0  HELLO      magic, version, rank, size, member nonce (16)
//   rank 0 -> member  CHALLENGE  magic, status, rank 0's nonce (16), rank 0's proof (32)
//   member -> rank 0  PROOF      the member's proof (32), sent only if rank 0's proof holds
//   rank 0 -> member  WELCOME    magic, status
// where a proof is HMAC(token, role | member nonce | rank 0's nonce | rank | size). The token
// never crosses the wire, and a recorded handshake is worthless with fresh nonces. Rank 0 runs
// every pending handshake at once (a silent connection delays no one), each bounded by 5 s.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "elastic/barrier.hpp"
#include "hmac.hpp"
#include "util.hpp"

namespace elastic {
namespace {

constexpr uint32_t kMagic = 0x31425445;  // "ETB1"
constexpr uint32_t kProtocolVersion = 2;
constexpr size_t kNonceSize = 16;
constexpr size_t kProofSize = 32;
constexpr size_t kHelloSize = 16 + kNonceSize;
constexpr size_t kChallengeSize = 8 + kNonceSize + kProofSize;
constexpr size_t kWelcomeSize = 8;
constexpr uint64_t kHandshakeNs = 5000000000ull;  // for each connecting peer
constexpr size_t kFrameSize = 16;
constexpr size_t kReasonSize = 240;

enum Welcome : uint32_t {
  kOk = 0,
  kBadToken = 1,
  kBadSize = 2,
  kBadRank = 3,
  kRankTaken = 4,
  kBadVersion = 5
};
enum FrameType : uint32_t { kArrive = 1, kRelease = 2, kAbort = 3 };

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

using detail::Digest;

// A proof of the token for one handshake: what only a holder of the token can compute.
Digest proof(const std::string& token, const char* role, const unsigned char* member_nonce,
             const unsigned char* leader_nonce, uint32_t rank, uint32_t size) {
  unsigned char msg[16 + 2 * kNonceSize + 8] = {};
  std::strncpy(reinterpret_cast<char*>(msg), role, 16);
  std::memcpy(msg + 16, member_nonce, kNonceSize);
  std::memcpy(msg + 16 + kNonceSize, leader_nonce, kNonceSize);
  put_u32(msg + 16 + 2 * kNonceSize, rank);
  put_u32(msg + 16 + 2 * kNonceSize + 4, size);
  return detail::hmac_sha256(token, msg, sizeof(msg));
}

void nonce(unsigned char* out) {
  if (!detail::random_bytes(out, kNonceSize)) {
    throw Error(ELASTIC_ERR_SYSTEM, "TCP barrier: the kernel gave no random bytes (getrandom)");
  }
}

struct HostPort {
  std::string host;
  std::string port;
};

HostPort parse_peer(const std::string& peer, uint32_t rank) {
  auto bad = [&](const std::string& why) {
    return Error(ELASTIC_ERR_INVALID_ARGUMENT, "peer " + std::to_string(rank) + " '" + peer +
                                                   "' is not host:port (" + why +
                                                   "); write it like 10.0.0.1:29400 or "
                                                   "[::1]:29400");
  };
  std::string host;
  std::string port;
  if (!peer.empty() && peer[0] == '[') {
    size_t close = peer.find(']');
    if (close == std::string::npos || close + 1 >= peer.size() || peer[close + 1] != ':') {
      throw bad("an IPv6 address needs brackets and a port");
    }
    host = peer.substr(1, close - 1);
    port = peer.substr(close + 2);
  } else {
    size_t colon = peer.rfind(':');
    if (colon == std::string::npos) throw bad("no port");
    host = peer.substr(0, colon);
    port = peer.substr(colon + 1);
    if (host.find(':') != std::string::npos) throw bad("an IPv6 address needs brackets");
  }
  if (host.empty()) throw bad("no host");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoul(port) > 65535) {
    throw bad("the port must be a number from 0 to 65535");
  }
  return {host, port};
}

addrinfo* resolve(const HostPort& hp, bool passive, const std::string& peer_name) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(hp.host.c_str(), hp.port.c_str(), &hints, &result);
  if (rc != 0) {
    throw Error(ELASTIC_ERR_NETWORK, "cannot resolve " + peer_name + ": " + gai_strerror(rc) +
                                         "; check the host name");
  }
  return result;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int remaining_ms(uint64_t deadline) {
  if (deadline == UINT64_MAX) return -1;
  uint64_t now = now_ns();
  if (now >= deadline) return 0;
  uint64_t ms = (deadline - now + 999999) / 1000000;
  return ms > INT32_MAX ? INT32_MAX : static_cast<int>(ms);
}

// Outcome of reading a whole buffer before a deadline.
enum class Read { kOk, kClosed, kTimeout, kError };

Read read_full(int fd, unsigned char* buf, size_t n, uint64_t deadline, int* err) {
  size_t got = 0;
  while (got < n) {
    pollfd p{fd, POLLIN, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return Read::kError;
    }
    if (rc == 0) return Read::kTimeout;
    ssize_t r = ::recv(fd, buf + got, n - got, 0);
    if (r == 0) return Read::kClosed;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      *err = errno;
      return errno == ECONNRESET ? Read::kClosed : Read::kError;
    }
    got += static_cast<size_t>(r);
  }
  return Read::kOk;
}

bool write_full(int fd, const unsigned char* buf, size_t n) {
  size_t sent = 0;
  while (sent < n) {
    ssize_t r = ::send(fd, buf + sent, n - sent, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    sent += static_cast<size_t>(r);
  }
  return true;
}

bool send_frame(int fd, uint32_t type, uint32_t culprit, uint64_t round,
                const std::string& reason = {}) {
  unsigned char buf[kFrameSize + kReasonSize] = {};
  put_u32(buf, type);
  put_u32(buf + 4, culprit);
  put_u64(buf + 8, round);
  size_t n = kFrameSize;
  if (type == kAbort) {
    detail::copy_string(reinterpret_cast<char*>(buf + kFrameSize), kReasonSize, reason);
    n += kReasonSize;
  }
  return write_full(fd, buf, n);
}

// One non-blocking connect to `a`, bounded by a second (or the deadline): the socket, or -1
// with `*last_err` set.
int connect_one(const addrinfo* a, uint64_t deadline, int* last_err) {
  int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
  if (s < 0) {
    *last_err = errno;
    return -1;
  }
  int rc = ::connect(s, a->ai_addr, a->ai_addrlen);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{s, POLLOUT, 0};
    int left = remaining_ms(deadline);
    rc = ::poll(&p, 1, std::min(left < 0 ? 1000 : left, 1000));
    int soerr = rc == 0 ? ETIMEDOUT : 0;
    socklen_t len = sizeof(soerr);
    if (rc > 0) getsockopt(s, SOL_SOCKET, SO_ERROR, &soerr, &len);
    rc = soerr == 0 ? 0 : -1;
    errno = soerr;
  }
  if (rc == 0) return s;
  *last_err = errno;
  ::close(s);
  return -1;
}

std::string welcome_text(uint32_t status) {
  switch (status) {
    case kBadToken:
      return "its token differs from this peer's: every peer must use the same token";
    case kBadSize:
      return "it was given a different number of peers: give every peer the same list";
    case kBadRank:
      return "this rank is out of its range";
    case kRankTaken:
      return "another peer already joined with this rank: give each peer its own rank";
    case kBadVersion:
      return "it speaks another protocol version: use the same elasticrun version everywhere";
    default:
      return "it refused the connection (status " + std::to_string(status) + ")";
  }
}

}  // namespace

TcpBarrier::TcpBarrier(std::vector<std::string> peers, uint32_t rank, const std::string& token,
                       int connect_timeout_ms)
    : peers_(std::move(peers)), rank_(rank), token_(token) {
  if (peers_.empty()) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT, "a TCP barrier needs at least one peer");
  }
  if (rank_ >= peers_.size()) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "rank " + std::to_string(rank_) + " is out of range for " +
                    std::to_string(peers_.size()) + " peers (0.." +
                    std::to_string(peers_.size() - 1) + ")");
  }
  for (uint32_t i = 0; i < peers_.size(); ++i) parse_peer(peers_[i], i);
  const uint64_t deadline = detail::deadline_after_ms(connect_timeout_ms);
  fds_.assign(peers_.size(), -1);
  try {
    if (rank_ == 0) {
      listen_on_own_entry();
      accept_members(deadline, connect_timeout_ms);
    } else {
      join_leader(deadline, connect_timeout_ms);
    }
  } catch (...) {
    close_all();
    throw;
  }
}

void TcpBarrier::listen_on_own_entry() {
  HostPort hp = parse_peer(peers_[0], 0);
  addrinfo* ai = resolve(hp, true, describe(0));
  int last_err = 0;
  for (addrinfo* a = ai; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::listen(fd, SOMAXCONN) == 0) {  // a full queue would drop a member's SYN
      listen_fd_ = fd;
    } else {
      last_err = errno;
      ::close(fd);
    }
  }
  freeaddrinfo(ai);
  if (listen_fd_ < 0) {
    throw detail::system_error(last_err, "cannot listen on " + describe(0) +
                                             " (is the port in use, or the address not "
                                             "this host's?)");
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  bound_port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

namespace {

// One connecting peer whose handshake rank 0 is running: what it has read so far, and what it
// waits for next (the HELLO, then the PROOF).
struct Pending {
  int fd = -1;
  uint64_t deadline = 0;
  bool hello_done = false;
  unsigned char buf[kHelloSize] = {};
  size_t got = 0;
  uint32_t rank = 0;
  unsigned char member_nonce[kNonceSize] = {};
  unsigned char leader_nonce[kNonceSize] = {};

  size_t want() const { return hello_done ? kProofSize : kHelloSize; }
};

// Send a small frame on a non-blocking socket, bounded by `deadline`.
bool send_small(int fd, const unsigned char* buf, size_t n, uint64_t deadline) {
  size_t sent = 0;
  while (sent < n) {
    ssize_t r = ::send(fd, buf + sent, n - sent, MSG_NOSIGNAL);
    if (r > 0) {
      sent += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, remaining_ms(deadline)) > 0) continue;
    }
    return false;
  }
  return true;
}

void send_status(int fd, uint32_t status, uint64_t deadline) {
  unsigned char frame[kChallengeSize] = {};
  put_u32(frame, kMagic);
  put_u32(frame + 4, status);
  send_small(fd, frame, status == kOk ? kWelcomeSize : kChallengeSize, deadline);
}

}  // namespace

void TcpBarrier::accept_members(uint64_t deadline, int connect_timeout_ms) {
  size_t joined = 1;
  std::vector<Pending> pending;
  auto drop = [&](size_t k) {
    ::close(pending[k].fd);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
  };
  // A whole message from pending[k]: the HELLO (answered with the CHALLENGE) or the PROOF
  // (answered with the WELCOME, and the peer joins). False: the connection is dropped.
  auto step = [&](Pending& c) -> bool {
    const uint32_t n = static_cast<uint32_t>(peers_.size());
    if (!c.hello_done) {
      if (get_u32(c.buf) != kMagic) return false;  // not one of ours (a scanner, a stray client)
      c.rank = get_u32(c.buf + 8);
      uint32_t status = kOk;
      if (get_u32(c.buf + 4) != kProtocolVersion) {
        status = kBadVersion;
      } else if (get_u32(c.buf + 12) != n) {
        status = kBadSize;
      } else if (c.rank == 0 || c.rank >= n) {
        status = kBadRank;
      } else if (fds_[c.rank] >= 0) {
        status = kRankTaken;
      }
      if (status != kOk) {
        send_status(c.fd, status, c.deadline);
        return false;
      }
      std::memcpy(c.member_nonce, c.buf + 16, kNonceSize);
      nonce(c.leader_nonce);
      unsigned char frame[kChallengeSize];
      put_u32(frame, kMagic);
      put_u32(frame + 4, kOk);
      std::memcpy(frame + 8, c.leader_nonce, kNonceSize);
      Digest mine = proof(token_, "leader", c.member_nonce, c.leader_nonce, c.rank, n);
      std::memcpy(frame + 8 + kNonceSize, mine.data(), kProofSize);
      c.hello_done = true;
      c.got = 0;
      return send_small(c.fd, frame, sizeof(frame), c.deadline);
    }
    Digest theirs = proof(token_, "member", c.member_nonce, c.leader_nonce, c.rank, n);
    uint32_t status = !detail::digests_equal(c.buf, theirs.data()) ? kBadToken
                      : fds_[c.rank] >= 0                          ? kRankTaken
                                                                   : kOk;
    unsigned char frame[kWelcomeSize];
    put_u32(frame, kMagic);
    put_u32(frame + 4, status);
    if (!send_small(c.fd, frame, sizeof(frame), c.deadline) || status != kOk) return false;
    ::fcntl(c.fd, F_SETFL, ::fcntl(c.fd, F_GETFL) & ~O_NONBLOCK);
    fds_[c.rank] = c.fd;
    c.fd = -1;  // joined: no longer pending
    ++joined;
    return true;
  };
  std::vector<pollfd> pfds;
  while (joined < peers_.size()) {
    const uint64_t now = now_ns();
    for (size_t k = pending.size(); k-- > 0;) {
      if (pending[k].deadline <= now) drop(k);  // too slow to say who it is
    }
    uint64_t wake = deadline;
    for (const Pending& c : pending) wake = std::min(wake, c.deadline);
    pfds.assign(1, pollfd{listen_fd_, POLLIN, 0});
    for (const Pending& c : pending) pfds.push_back({c.fd, POLLIN, 0});
    int rc = ::poll(pfds.data(), pfds.size(), remaining_ms(wake));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0 || (rc == 0 && now_ns() >= deadline)) break;
    for (size_t k = pending.size(); k-- > 0;) {
      if (pfds[k + 1].revents == 0) continue;
      Pending& c = pending[k];
      ssize_t r = ::recv(c.fd, c.buf + c.got, c.want() - c.got, 0);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (r <= 0) {
        drop(k);
        continue;
      }
      c.got += static_cast<size_t>(r);
      if (c.got < c.want()) continue;
      if (!step(c)) {
        drop(k);
      } else if (c.fd < 0) {
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
    if (pfds[0].revents != 0) {
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0 && pending.size() >= 4 * peers_.size() + 16) {
        // Room is made by the connection that has been silent longest: a member says HELLO
        // as it connects, so silent strangers, however many, never keep one out.
        size_t oldest = pending.size();
        for (size_t k = 0; k < pending.size(); ++k) {
          if (pending[k].got == 0 && !pending[k].hello_done &&
              (oldest == pending.size() || pending[k].deadline < pending[oldest].deadline)) {
            oldest = k;
          }
        }
        if (oldest < pending.size()) {
          drop(oldest);
        } else {
          ::close(fd);  // every one is mid-handshake: the newcomer waits for the next accept
          fd = -1;
        }
      }
      if (fd >= 0) {
        set_nodelay(fd);
        Pending c;
        c.fd = fd;
        c.deadline = std::min(deadline, now_ns() + kHandshakeNs);
        pending.push_back(c);
      }
    }
  }
  for (Pending& c : pending) ::close(c.fd);
  if (joined == peers_.size()) return;
  std::string missing;
  int first = -1;
  for (uint32_t i = 1; i < peers_.size(); ++i) {
    if (fds_[i] < 0) {
      if (first < 0) first = static_cast<int>(i);
      missing += (missing.empty() ? "" : ", ") + describe(i);
    }
  }
  throw Error(ELASTIC_ERR_TIMEOUT, "TCP barrier: " + missing + " did not connect within " +
                                       std::to_string(connect_timeout_ms) +
                                       " ms; check that they run and can reach " + describe(0))
      .with_culprit(first);
}

int TcpBarrier::connect_to_leader(uint64_t deadline, int connect_timeout_ms) {
  HostPort hp = parse_peer(peers_[0], 0);
  addrinfo* ai = resolve(hp, false, describe(0));
  int last_err = ETIMEDOUT;
  int fd = -1;
  while (fd < 0) {
    for (addrinfo* a = ai; a != nullptr && fd < 0; a = a->ai_next) {
      fd = connect_one(a, deadline, &last_err);
    }
    if (fd >= 0 || remaining_ms(deadline) == 0) break;
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(50, std::max(1, remaining_ms(deadline)))));
  }
  freeaddrinfo(ai);
  if (fd < 0) {
    throw Error(ELASTIC_ERR_NETWORK,
                "TCP barrier: " + describe(0) + " is unreachable: " + std::strerror(last_err) +
                    " (retried for " + std::to_string(connect_timeout_ms) +
                    " ms); check that rank 0 runs and listens there")
        .with_culprit(0);
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  set_nodelay(fd);
  return fd;
}

void TcpBarrier::join_leader(uint64_t deadline, int connect_timeout_ms) {
  // Rank 0 may close a connection before answering it (it made room for another when strangers
  // filled its queue, or it is starting over): connecting again within the deadline is safe,
  // since nothing derived from the token was sent.
  for (;;) {
    fds_[0] = connect_to_leader(deadline, connect_timeout_ms);
    if (handshake(fds_[0], deadline)) return;
    ::close(fds_[0]);
    fds_[0] = -1;
    if (now_ns() >= deadline) {
      throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) +
                                           " closed every connection before answering within " +
                                           std::to_string(connect_timeout_ms) +
                                           " ms: is it an elasticrun TCP barrier?")
          .with_culprit(0);
    }
    ::usleep(10000);
  }
}

bool TcpBarrier::handshake(int fd, uint64_t deadline) {
  const uint32_t n = static_cast<uint32_t>(peers_.size());
  unsigned char hello[kHelloSize];
  put_u32(hello, kMagic);
  put_u32(hello + 4, kProtocolVersion);
  put_u32(hello + 8, rank_);
  put_u32(hello + 12, n);
  nonce(hello + 16);
  unsigned char challenge[kChallengeSize] = {};
  int err = 0;
  auto unanswered = [&] {
    return Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) +
                                          " did not answer the handshake: is it an "
                                          "elasticrun TCP barrier of the same version?")
        .with_culprit(0);
  };
  // A refusal is a short frame (magic, status) or a full one: read the status first. Closed
  // before a word: false, and the caller connects again.
  if (!write_full(fd, hello, kHelloSize)) return false;
  Read first = read_full(fd, challenge, kWelcomeSize, deadline, &err);
  if (first == Read::kClosed) return false;
  if (first != Read::kOk || get_u32(challenge) != kMagic) throw unanswered();
  uint32_t status = get_u32(challenge + 4);
  if (status != kOk) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) + " refused rank " +
                                         std::to_string(rank_) + ": " + welcome_text(status))
        .with_culprit(0);
  }
  if (read_full(fd, challenge + kWelcomeSize, kChallengeSize - kWelcomeSize, deadline, &err) !=
      Read::kOk) {
    throw unanswered();
  }
  const unsigned char* leader_nonce = challenge + 8;
  Digest expected = proof(token_, "leader", hello + 16, leader_nonce, rank_, n);
  if (!detail::digests_equal(challenge + 8 + kNonceSize, expected.data())) {
    // Nothing more is sent: a peer that cannot prove it holds the token learns nothing.
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) +
                                         " did not prove it holds this barrier's token: every "
                                         "peer must use the same token")
        .with_culprit(0);
  }
  Digest mine = proof(token_, "member", hello + 16, leader_nonce, rank_, n);
  unsigned char welcome[kWelcomeSize] = {};
  if (!write_full(fd, mine.data(), kProofSize) ||
      read_full(fd, welcome, kWelcomeSize, deadline, &err) != Read::kOk ||
      get_u32(welcome) != kMagic) {
    throw unanswered();
  }
  status = get_u32(welcome + 4);
  if (status != kOk) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) + " refused rank " +
                                         std::to_string(rank_) + ": " + welcome_text(status))
        .with_culprit(0);
  }
  return true;
}

TcpBarrier::~TcpBarrier() { close_all(); }

void TcpBarrier::close_all() noexcept {
  for (int& fd : fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

std::string TcpBarrier::describe(uint32_t rank) const {
  return "peer " + std::to_string(rank) + " (" + peers_[rank] + ")";
}

void TcpBarrier::wait(int timeout_ms) {
  if (broken_) {
    throw Error(ELASTIC_ERR_STATE,
                "TCP barrier is broken (" + broken_reason_ + "): make a new one");
  }
  const uint64_t deadline = detail::deadline_after_ms(timeout_ms);
  ++round_;
  try {
    if (rank_ == 0) {
      wait_leader(deadline);
    } else {
      wait_member(deadline);
    }
  } catch (const Error& e) {
    broken_ = true;
    broken_reason_ = e.what();
    throw;
  }
}

void TcpBarrier::wait_leader(uint64_t deadline) {
  const size_t n = peers_.size();
  std::vector<bool> arrived(n, false);
  arrived[0] = true;
  size_t count = 1;
  auto abort_all = [&](uint32_t culprit, const std::string& reason) {
    for (uint32_t i = 1; i < n; ++i) {
      if (fds_[i] >= 0) send_frame(fds_[i], kAbort, culprit, round_, reason);
    }
  };
  std::vector<pollfd> pfds;
  std::vector<uint32_t> ranks;
  while (count < n) {
    pfds.clear();
    ranks.clear();
    for (uint32_t i = 1; i < n; ++i) {
      if (!arrived[i]) {
        pfds.push_back({fds_[i], POLLIN, 0});
        ranks.push_back(i);
      }
    }
    int rc = ::poll(pfds.data(), pfds.size(), remaining_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) {
      std::string missing;
      for (uint32_t r : ranks) missing += (missing.empty() ? "" : ", ") + describe(r);
      std::string reason = missing + " did not arrive at round " + std::to_string(round_) +
                           " in time";
      abort_all(ranks.front(), reason);
      throw Error(ELASTIC_ERR_TIMEOUT, "TCP barrier: " + reason).with_culprit(ranks.front());
    }
    for (size_t k = 0; k < pfds.size(); ++k) {
      if (pfds[k].revents == 0) continue;
      uint32_t r = ranks[k];
      unsigned char frame[kFrameSize];
      int err = 0;
      Read res = read_full(fds_[r], frame, kFrameSize, deadline, &err);
      if (res != Read::kOk || get_u32(frame) != kArrive || get_u64(frame + 8) != round_) {
        std::string reason =
            describe(r) + (res == Read::kOk ? " broke the protocol" : " closed the connection") +
            " during round " + std::to_string(round_);
        abort_all(r, reason);
        throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + reason).with_culprit(static_cast<int>(r));
      }
      arrived[r] = true;
      ++count;
    }
  }
  for (uint32_t i = 1; i < n; ++i) {
    if (!send_frame(fds_[i], kRelease, 0, round_)) {
      // The round is complete; the failed peer will find out on its side. Report it next round.
      std::string reason = describe(i) + " closed the connection after round " +
                           std::to_string(round_);
      abort_all(i, reason);
      throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + reason).with_culprit(static_cast<int>(i));
    }
  }
}

void TcpBarrier::wait_member(uint64_t deadline) {
  if (!send_frame(fds_[0], kArrive, rank_, round_)) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) + " closed the connection")
        .with_culprit(0);
  }
  unsigned char frame[kFrameSize + kReasonSize] = {};
  int err = 0;
  Read res = read_full(fds_[0], frame, kFrameSize, deadline, &err);
  if (res == Read::kTimeout) {
    throw Error(ELASTIC_ERR_TIMEOUT, "TCP barrier: " + describe(0) +
                                         " did not release round " + std::to_string(round_) +
                                         " in time (other peers have not arrived)")
        .with_culprit(0);
  }
  if (res != Read::kOk) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) +
                                         " closed the connection during round " +
                                         std::to_string(round_))
        .with_culprit(0);
  }
  uint32_t type = get_u32(frame);
  if (type == kAbort) {
    uint32_t culprit = get_u32(frame + 4);
    std::string reason = "(its reason was cut short)";
    if (read_full(fds_[0], frame + kFrameSize, kReasonSize, deadline, &err) == Read::kOk) {
      const char* text = reinterpret_cast<const char*>(frame + kFrameSize);
      reason.assign(text, ::strnlen(text, kReasonSize));
    }
    throw Error(ELASTIC_ERR_ABORTED,
                std::string("TCP barrier aborted by ") + describe(0) + ": " + reason)
        .with_culprit(culprit < peers_.size() ? static_cast<int>(culprit) : -1);
  }
  if (type != kRelease || get_u64(frame + 8) != round_) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) + " broke the protocol")
        .with_culprit(0);
  }
}

}  // namespace elastic
