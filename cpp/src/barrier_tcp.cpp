// The TCP barrier among node leaders: a star around rank 0. A round is one ARRIVE from every
// member and one RELEASE back, so it costs two network latencies whatever the size. Frames are a
// fixed little-endian layout; the handshake checks a protocol magic, the job size and a token.
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
#include "util.hpp"

namespace elastic {
namespace {

constexpr uint32_t kMagic = 0x31425445;  // "ETB1"
constexpr uint32_t kProtocolVersion = 1;
constexpr size_t kHelloSize = 24;
constexpr size_t kWelcomeSize = 8;
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

// FNV-1a: the token guards against joining the wrong job by accident; it is not authentication.
uint64_t hash_token(const std::string& token) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : token) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
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
    : peers_(std::move(peers)), rank_(rank), token_hash_(hash_token(token)) {
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
      fds_[0] = connect_to_leader(deadline, connect_timeout_ms);
      handshake(fds_[0], deadline);
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
        ::listen(fd, static_cast<int>(peers_.size())) == 0) {
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

void TcpBarrier::accept_members(uint64_t deadline, int connect_timeout_ms) {
  size_t joined = 1;
  while (joined < peers_.size()) {
    pollfd p{listen_fd_, POLLIN, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) break;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_nodelay(fd);
    if (admit(fd, deadline)) ++joined;
  }
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

bool TcpBarrier::admit(int fd, uint64_t deadline) {
  unsigned char hello[kHelloSize];
  int err = 0;
  uint64_t hello_deadline = now_ns() + 5000000000ull;
  if (read_full(fd, hello, kHelloSize, std::min(deadline, hello_deadline), &err) != Read::kOk ||
      get_u32(hello) != kMagic) {
    ::close(fd);  // not one of ours (a port scanner, a stray client)
    return false;
  }
  uint32_t their_rank = get_u32(hello + 8);
  uint32_t status = kOk;
  if (get_u32(hello + 4) != kProtocolVersion) {
    status = kBadVersion;
  } else if (get_u64(hello + 16) != token_hash_) {
    status = kBadToken;
  } else if (get_u32(hello + 12) != peers_.size()) {
    status = kBadSize;
  } else if (their_rank == 0 || their_rank >= peers_.size()) {
    status = kBadRank;
  } else if (fds_[their_rank] >= 0) {
    status = kRankTaken;
  }
  unsigned char welcome[kWelcomeSize];
  put_u32(welcome, kMagic);
  put_u32(welcome + 4, status);
  bool sent = write_full(fd, welcome, kWelcomeSize);
  if (status != kOk || !sent) {
    ::close(fd);
    return false;
  }
  fds_[their_rank] = fd;
  return true;
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

void TcpBarrier::handshake(int fd, uint64_t deadline) {
  unsigned char hello[kHelloSize];
  put_u32(hello, kMagic);
  put_u32(hello + 4, kProtocolVersion);
  put_u32(hello + 8, rank_);
  put_u32(hello + 12, static_cast<uint32_t>(peers_.size()));
  put_u64(hello + 16, token_hash_);
  unsigned char welcome[kWelcomeSize];
  int err = 0;
  if (!write_full(fd, hello, kHelloSize) ||
      read_full(fd, welcome, kWelcomeSize, deadline, &err) != Read::kOk ||
      get_u32(welcome) != kMagic) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) +
                                         " did not answer the handshake: is it an "
                                         "elasticrun TCP barrier of the same version?")
        .with_culprit(0);
  }
  uint32_t status = get_u32(welcome + 4);
  if (status != kOk) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) + " refused rank " +
                                         std::to_string(rank_) + ": " + welcome_text(status))
        .with_culprit(0);
  }
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
  unsigned char frame[kFrameSize + kReasonSize];
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
    auto culprit = static_cast<int>(get_u32(frame + 4));
    read_full(fds_[0], frame + kFrameSize, kReasonSize, deadline, &err);
    frame[kFrameSize + kReasonSize - 1] = 0;
    throw Error(ELASTIC_ERR_ABORTED, std::string("TCP barrier aborted by ") + describe(0) + ": " +
                                         reinterpret_cast<char*>(frame + kFrameSize))
        .with_culprit(culprit);
  }
  if (type != kRelease || get_u64(frame + 8) != round_) {
    throw Error(ELASTIC_ERR_NETWORK, "TCP barrier: " + describe(0) + " broke the protocol")
        .with_culprit(0);
  }
}

}  // namespace elastic
