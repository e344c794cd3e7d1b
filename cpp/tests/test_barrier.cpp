#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "../src/hmac.hpp"
#include "elastic/barrier.hpp"
#include "elastic/watchdog.hpp"
#include "test_util.hpp"

using elastic::Error;
using elastic::LocalBarrier;
using elastic::TcpBarrier;
using elastic_test::Child;
using elastic_test::shm_path;

namespace {

// Exit codes of barrier children, read by the parent.
constexpr int kOk = 0;
constexpr int kFailed = 10;
constexpr int kAborted = 11;
constexpr int kTimedOut = 12;

int code_of(Child& c) {
  int st = c.wait();
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st);
}

int free_port() {
  // Bind port 0 through a barrier of one, which reports the port it got.
  TcpBarrier probe({"127.0.0.1:0"}, 0, "", 1000);
  return probe.bound_port();
}

}  // namespace

TEST(LocalBarrier, FourProcessesPassAThousandRounds) {
  std::string path = shm_path("bar4");
  LocalBarrier owner = LocalBarrier::create(path, 4);
  std::vector<std::unique_ptr<Child>> children;
  for (uint32_t i = 0; i < 4; ++i) {
    children.push_back(std::make_unique<Child>([&, i] {
      try {
        LocalBarrier b = LocalBarrier::open(path, i);
        for (int r = 0; r < 1000; ++r) b.wait(20000);
      } catch (...) {
        ::_exit(kFailed);
      }
      ::_exit(kOk);
    }));
  }
  for (auto& c : children) EXPECT_EQ(code_of(*c), kOk);
  EXPECT_EQ(owner.rounds(), 1000u);
  EXPECT_FALSE(owner.aborted());
}

TEST(LocalBarrier, WatchdogAbortsItWhenAParticipantIsKilled) {
  std::string path = shm_path("bar-abort");
  LocalBarrier owner = LocalBarrier::create(path, 3);
  elastic::Watchdog wd;
  wd.attach_barrier(&owner);
  std::vector<std::unique_ptr<Child>> waiters;
  for (uint32_t i = 0; i < 2; ++i) {
    waiters.push_back(std::make_unique<Child>([&, i] {
      LocalBarrier b = LocalBarrier::open(path, i);
      try {
        b.wait(60000);  // participant 2 never arrives: it is killed
      } catch (const Error& e) {
        bool named = std::string(e.what()).find("worker 2") != std::string::npos &&
                     e.culprit() == 2;
        ::_exit(e.status() == ELASTIC_ERR_ABORTED && named ? kAborted : kFailed);
      }
      ::_exit(kOk);
    }));
  }
  Child doomed([&] {
    LocalBarrier b = LocalBarrier::open(path, 2);
    ::pause();
  });
  wd.watch(2, doomed.pid());
  wd.start();
  ::usleep(100000);  // let the others block in wait()
  uint64_t t0 = elastic::now_ns();
  doomed.kill();
  for (auto& w : waiters) EXPECT_EQ(code_of(*w), kAborted);
  EXPECT_LT((elastic::now_ns() - t0) / 1000000, 30000u) << "aborted, not timed out";
  EXPECT_TRUE(owner.aborted());
  try {
    LocalBarrier late = LocalBarrier::open(path, 0);
    late.wait(1000);
    FAIL() << "a broken barrier stays broken";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_ABORTED);
    EXPECT_NE(std::string(e.what()).find("SIGKILL"), std::string::npos) << e.what();
  }
  owner.reset();
  EXPECT_FALSE(owner.aborted());
}

TEST(LocalBarrier, TimeoutNamesWhoDidNotArrive) {
  std::string path = shm_path("bar-timeout");
  LocalBarrier owner = LocalBarrier::create(path, 3);
  LocalBarrier p0 = LocalBarrier::open(path, 0);
  try {
    p0.wait(100);
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_TIMEOUT);
    EXPECT_EQ(e.culprit(), 1);
    EXPECT_NE(std::string(e.what()).find("participant(s) 1, 2 did not arrive within 100 ms"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(owner.aborted());
}

TEST(LocalBarrier, BadArgumentsAndFilesAreClearErrors) {
  auto message = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  std::string path = shm_path("bar-bad");
  EXPECT_NE(message([&] { LocalBarrier::create(path, 0); }).find("got 0"), std::string::npos);
  LocalBarrier owner = LocalBarrier::create(path, 2);
  EXPECT_NE(message([&] { LocalBarrier::open(path, 2); }).find("participant 2 is out of range"),
            std::string::npos);
  EXPECT_NE(message([&] { owner.wait(10); }).find("not a participant"), std::string::npos);
  std::string hb = shm_path("not-a-barrier");
  elastic_test::write_file(hb, std::string(1024, 'z'));
  EXPECT_NE(message([&] { LocalBarrier::open(hb, 0); }).find("not an elasticrun barrier"),
            std::string::npos);
  ::unlink(hb.c_str());
  EXPECT_NE(message([&] { LocalBarrier::open(shm_path("nope"), 0); }).find("does not exist"),
            std::string::npos);
}

TEST(TcpBarrier, ThreePeersPassRounds) {
  std::string leader = "127.0.0.1:" + std::to_string(free_port());
  std::vector<std::string> peers = {leader, "127.0.0.1:1", "127.0.0.1:2"};
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (uint32_t r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      TcpBarrier b(peers, r, "job-1", 10000);
      for (int i = 0; i < 200; ++i) b.wait(10000);
      EXPECT_EQ(b.rounds(), 200u);
      ++ok;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 3);
}

TEST(TcpBarrier, UnreachableLeaderIsNamed) {
  std::string leader = "127.0.0.1:" + std::to_string(free_port());  // nobody listens now
  try {
    TcpBarrier b({leader, "127.0.0.1:1"}, 1, "", 300);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_NETWORK);
    EXPECT_EQ(e.culprit(), 0);
    std::string msg = e.what();
    EXPECT_NE(msg.find("peer 0 (" + leader + ") is unreachable"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Connection refused"), std::string::npos) << msg;
  }
}

TEST(TcpBarrier, MemberThatNeverComesIsNamed) {
  std::string leader = "127.0.0.1:" + std::to_string(free_port());
  try {
    TcpBarrier b({leader, "10.9.9.9:7", "127.0.0.1:8"}, 0, "", 300);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_TIMEOUT);
    EXPECT_EQ(e.culprit(), 1);
    std::string msg = e.what();
    EXPECT_NE(msg.find("peer 1 (10.9.9.9:7), peer 2 (127.0.0.1:8) did not connect within 300 ms"),
              std::string::npos)
        << msg;
  }
}

TEST(TcpBarrier, WrongTokenIsRefused) {
  std::string leader = "127.0.0.1:" + std::to_string(free_port());
  std::thread lead([&] {
    try {
      TcpBarrier b({leader, "127.0.0.1:1"}, 0, "right", 1500);
    } catch (const Error&) {
      // times out: the only member was refused
    }
  });
  try {
    TcpBarrier b({leader, "127.0.0.1:1"}, 1, "wrong", 1000);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_NETWORK);
    EXPECT_NE(std::string(e.what()).find("did not prove it holds this barrier's token"),
              std::string::npos)
        << e.what();
  }
  lead.join();
}

namespace {

// A socket listening on 127.0.0.1:port, for a test to play rank 0 by hand.
int listen_on(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 8) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

size_t read_some(int fd, unsigned char* buf, size_t n, int timeout_ms) {
  size_t got = 0;
  while (got < n) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) break;
    ssize_t r = ::recv(fd, buf + got, n - got, 0);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

}  // namespace

TEST(TcpBarrier, AMemberSendsNothingToALeaderThatCannotProveTheToken) {
  // An impostor at rank 0's address answers the HELLO with a made-up proof: the member stops
  // there, and what it sent (the HELLO) holds nothing derived from the token.
  int port = free_port();
  int lfd = listen_on(port);
  ASSERT_GE(lfd, 0);
  std::vector<unsigned char> after_challenge;
  std::thread impostor([&] {
    int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    unsigned char hello[32];
    ASSERT_EQ(read_some(fd, hello, sizeof(hello), 5000), sizeof(hello));
    unsigned char challenge[56] = {0x45, 0x54, 0x42, 0x31};  // magic, status 0, then junk
    for (size_t i = 8; i < sizeof(challenge); ++i) challenge[i] = static_cast<unsigned char>(i);
    ASSERT_EQ(::send(fd, challenge, sizeof(challenge), MSG_NOSIGNAL), 56);
    unsigned char rest[64];
    size_t n = read_some(fd, rest, sizeof(rest), 2000);
    after_challenge.assign(rest, rest + n);
    ::close(fd);
  });
  try {
    TcpBarrier b({"127.0.0.1:" + std::to_string(port), "127.0.0.1:1"}, 1, "secret", 3000);
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("did not prove it holds this barrier's token"),
              std::string::npos)
        << e.what();
  }
  impostor.join();
  ::close(lfd);
  EXPECT_TRUE(after_challenge.empty()) << "the member sent its proof to an impostor";
}

TEST(TcpBarrier, SilentConnectionsDelayNoOne) {
  // Rank 0 handshakes with every connecting peer at once: connections that never say a word
  // (a port scanner) cost nobody their handshake. One at a time, each cost 5 s, and two of
  // them outlasted this test's 3 s to connect.
  int port = free_port();
  std::string leader = "127.0.0.1:" + std::to_string(port);
  std::vector<std::string> peers = {leader, "127.0.0.1:1", "127.0.0.1:2"};
  std::atomic<int> formed{0};
  std::vector<int> silent;
  std::thread lead([&] {
    TcpBarrier b(peers, 0, "t", 3000);
    b.wait(3000);
    ++formed;
  });
  for (int tries = 0; silent.size() < 2 && tries < 200; ++tries) {
    int fd = connect_to(port);
    if (fd >= 0) {
      silent.push_back(fd);
    } else {
      ::usleep(10000);
    }
  }
  ASSERT_EQ(silent.size(), 2u);
  std::vector<std::thread> members;
  for (uint32_t r = 1; r < 3; ++r) {
    members.emplace_back([&, r] {
      TcpBarrier b(peers, r, "t", 3000);
      b.wait(3000);
      ++formed;
    });
  }
  for (auto& t : members) t.join();
  lead.join();
  for (int fd : silent) ::close(fd);
  EXPECT_EQ(formed.load(), 3);
}

TEST(TcpBarrier, TwoHundredSilentConnectionsKeepNoMemberOut) {
  // Rank 0 holds at most 4n+16 connections that have not finished their handshake; when
  // strangers fill that room, the one silent longest makes way, so a member (who speaks as it
  // connects) always gets in. Before, the newcomer was the one closed: 24 idle connections
  // kept the barrier from forming until they reached their 5 s handshake limit, past this
  // test's 3 s to connect.
  int port = free_port();
  std::string leader = "127.0.0.1:" + std::to_string(port);
  std::vector<std::string> peers = {leader, "127.0.0.1:1"};
  std::atomic<int> formed{0};
  std::thread lead([&] {
    TcpBarrier b(peers, 0, "t", 3000);
    b.wait(3000);
    ++formed;
  });
  std::vector<int> silent;
  for (int tries = 0; silent.size() < 200 && tries < 2000; ++tries) {
    int fd = connect_to(port);
    if (fd >= 0) {
      silent.push_back(fd);
    } else {
      ::usleep(5000);
    }
  }
  ASSERT_EQ(silent.size(), 200u);
  std::thread member([&] {
    TcpBarrier b(peers, 1, "t", 3000);
    b.wait(3000);
    ++formed;
  });
  member.join();
  lead.join();
  for (int fd : silent) ::close(fd);
  EXPECT_EQ(formed.load(), 2);
}

TEST(TcpBarrier, AnAbortCutShortIsReadWithinItsFrame) {
  // Rank 0, played by hand (the handshake computed from the protocol's description), sends an
  // ABORT whose reason never comes and whose culprit is out of range: the member reports just
  // that, with no stray bytes and no culprit.
  int port = free_port();
  int lfd = listen_on(port);
  ASSERT_GE(lfd, 0);
  auto put32 = [](unsigned char* p, uint32_t v) {
    for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
  };
  std::thread fake([&] {
    int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    unsigned char hello[32];
    ASSERT_EQ(read_some(fd, hello, sizeof(hello), 5000), sizeof(hello));
    unsigned char leader_nonce[16] = {7};
    unsigned char msg[48] = {};
    std::memcpy(msg, "leader", 6);
    std::memcpy(msg + 16, hello + 16, 16);
    std::memcpy(msg + 32, leader_nonce, 16);
    std::vector<unsigned char> full(msg, msg + 48);
    full.insert(full.end(), hello + 8, hello + 16);  // rank, size
    auto mac = elastic::detail::hmac_sha256("t", full.data(), full.size());
    unsigned char challenge[56] = {};
    put32(challenge, 0x31425445);
    std::memcpy(challenge + 8, leader_nonce, 16);
    std::memcpy(challenge + 24, mac.data(), 32);
    ::send(fd, challenge, sizeof(challenge), MSG_NOSIGNAL);
    unsigned char member_proof[32];
    read_some(fd, member_proof, sizeof(member_proof), 5000);
    unsigned char welcome[8] = {};
    put32(welcome, 0x31425445);
    ::send(fd, welcome, sizeof(welcome), MSG_NOSIGNAL);
    unsigned char arrive[16];
    read_some(fd, arrive, sizeof(arrive), 5000);
    unsigned char abort_head[16] = {};
    put32(abort_head, 3);        // ABORT
    put32(abort_head + 4, 99);   // a culprit no peer is
    abort_head[8] = 1;           // round 1
    ::send(fd, abort_head, sizeof(abort_head), MSG_NOSIGNAL);
    ::close(fd);                 // and no reason
  });
  try {
    TcpBarrier b({"127.0.0.1:" + std::to_string(port), "127.0.0.1:1"}, 1, "t", 3000);
    b.wait(3000);
    ADD_FAILURE() << "expected an abort";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_EQ(e.status(), ELASTIC_ERR_ABORTED) << what;
    EXPECT_NE(what.find("(its reason was cut short)"), std::string::npos) << what;
    EXPECT_EQ(e.culprit(), -1);
  }
  fake.join();
  ::close(lfd);
}

TEST(Hmac, KnownAnswers) {
  // FIPS 180-4 examples and RFC 4231's test cases 1 and 2.
  auto hex = [](const elastic::detail::Digest& d) {
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : d) {
      out += digits[c >> 4];
      out += digits[c & 15];
    }
    return out;
  };
  auto bytes = [](const std::string& s) { return reinterpret_cast<const unsigned char*>(s.data()); };
  EXPECT_EQ(hex(elastic::detail::sha256(bytes(""), 0)),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(elastic::detail::sha256(bytes("abc"), 3)),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(hex(elastic::detail::sha256(bytes(two_blocks), two_blocks.size())),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  std::string data = "Hi There";
  EXPECT_EQ(hex(elastic::detail::hmac_sha256(std::string(20, '\x0b'), bytes(data), data.size())),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  std::string what = "what do ya want for nothing?";
  EXPECT_EQ(hex(elastic::detail::hmac_sha256("Jefe", bytes(what), what.size())),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(TcpBarrier, PeerThatDiesMidRoundIsNamed) {
  std::string leader = "127.0.0.1:" + std::to_string(free_port());
  std::vector<std::string> peers = {leader, "127.0.0.1:1", "127.0.0.1:2"};
  Child dying([&] {
    TcpBarrier b(peers, 2, "", 10000);
    b.wait(10000);
    ::_exit(0);  // leaves before round 2
  });
  std::thread member([&] {
    TcpBarrier b(peers, 1, "", 10000);
    b.wait(10000);
    try {
      b.wait(10000);
      ADD_FAILURE() << "round 2 cannot complete";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), ELASTIC_ERR_ABORTED);
      EXPECT_EQ(e.culprit(), 2);
      EXPECT_NE(std::string(e.what()).find("peer 2 (127.0.0.1:2) closed the connection"),
                std::string::npos)
          << e.what();
    }
  });
  TcpBarrier b(peers, 0, "", 10000);
  b.wait(10000);
  try {
    b.wait(10000);
    ADD_FAILURE() << "round 2 cannot complete";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_NETWORK);
    EXPECT_EQ(e.culprit(), 2);
  }
  member.join();
  try {
    b.wait(100);
    ADD_FAILURE() << "a broken TCP barrier stays broken";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_STATE);
  }
}

TEST(TcpBarrier, BadPeerListsAreClearErrors) {
  auto message = [](std::vector<std::string> peers, uint32_t rank) -> std::string {
    try {
      TcpBarrier b(std::move(peers), rank, "", 100);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message({"localhost"}, 0).find("peer 0 'localhost' is not host:port (no port)"),
            std::string::npos);
  EXPECT_NE(message({"h:1", "h:99999"}, 0).find("peer 1 'h:99999'"), std::string::npos);
  EXPECT_NE(message({"::1:5"}, 0).find("needs brackets"), std::string::npos);
  EXPECT_NE(message({"h:1"}, 3).find("rank 3 is out of range"), std::string::npos);
  EXPECT_NE(message({}, 0).find("at least one peer"), std::string::npos);
}

TEST(LocalBarrier, AParticipantOverwritingTheSegmentNeverCrashesTheCreator) {
  // Any participant maps the segment read-write. Its creator (a supervisor) keeps its own
  // party count, and reads the abort reason within its buffer whatever the bytes are.
  for (int pattern : {0x00, 0xff, 0x5a}) {
    std::string path = shm_path("bar-scribble");
    LocalBarrier owner = LocalBarrier::create(path, 2);
    Child scribbler([&] {
      LocalBarrier b = LocalBarrier::open(path, 1);
      int fd = ::open(elastic_test::segment_of(path).c_str(), O_RDWR);
      struct stat st {};
      ::fstat(fd, &st);
      std::vector<unsigned char> junk(static_cast<size_t>(st.st_size),
                                      static_cast<unsigned char>(pattern));
      ssize_t n = ::pwrite(fd, junk.data(), junk.size(), 0);
      ::_exit(n == static_cast<ssize_t>(junk.size()) ? kOk : kFailed);
    });
    ASSERT_EQ(code_of(scribbler), kOk);
    EXPECT_EQ(owner.parties(), 2u);
    (void)owner.rounds();
    (void)owner.aborted();
    owner.reset();
    owner.abort(1, "participant 1 scribbled");
    EXPECT_TRUE(owner.aborted());
    owner.reset();
    EXPECT_FALSE(owner.aborted());
  }
}

TEST(LocalBarrier, NoParticipantCanCutTheMemoryUnderTheOthers) {
  // The segment is a memfd sealed against shrinking and growing: a participant that tries is
  // refused by the kernel, so no mapping of it can fault (a cut tmpfs file gave the waiter a
  // SIGBUS). What a participant can do to the locator file reaches newcomers only.
  std::string path = shm_path("bar-cut");
  LocalBarrier owner = LocalBarrier::create(path, 2);
  LocalBarrier a = LocalBarrier::open(path, 0);
  Child cutter([&] {
    LocalBarrier b = LocalBarrier::open(path, 1);
    const std::string segment = elastic_test::segment_of(path);
    bool refused = ::truncate(segment.c_str(), 0) != 0 && errno == EPERM &&
                   ::truncate(segment.c_str(), 1 << 20) != 0 && errno == EPERM;
    ::unlink(path.c_str());  // and the locator: replaced by junk
    elastic_test::write_file(path, "junk\n");
    b.wait(30000);
    ::_exit(refused ? kOk : kFailed);
  });
  a.wait(30000);  // the round completes with both: neither faulted
  ASSERT_EQ(code_of(cutter), kOk);
  EXPECT_EQ(owner.rounds(), 1u);
  std::string msg;
  try {
    LocalBarrier::open(path, 1);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("is not an elasticrun barrier"), std::string::npos)
      << msg << " locator: " << elastic_test::segment_of(path);
}

TEST(LocalBarrier, AnUnterminatedAbortReasonIsReadWithinItsBuffer) {
  std::string path = shm_path("bar-reason");
  LocalBarrier owner = LocalBarrier::create(path, 2);
  LocalBarrier me = LocalBarrier::open(path, 0);
  int fd = ::open(elastic_test::segment_of(path).c_str(), O_RDWR);
  struct stat st {};
  ::fstat(fd, &st);
  std::vector<unsigned char> bytes(static_cast<size_t>(st.st_size));
  ASSERT_EQ(::pread(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  owner.abort(7, "x");  // sets the abort bit; now fill the reason with no NUL at all
  ASSERT_EQ(::pread(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  size_t at = 0;
  for (; at + 1 < bytes.size(); ++at) {
    if (bytes[at] == 'x' && bytes[at + 1] == 0) break;
  }
  ASSERT_LT(at + 1, bytes.size());
  std::vector<unsigned char> fill(244, 'A');
  ASSERT_EQ(::pwrite(fd, fill.data(), fill.size(), static_cast<off_t>(at)), 244);
  ::close(fd);
  try {
    me.wait(1000);
    FAIL() << "an aborted barrier throws";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find(std::string(244, 'A') + " (reset"), std::string::npos) << what;
    EXPECT_EQ(e.culprit(), -1) << "participant 7 is out of range for 2 parties";
  }
}
