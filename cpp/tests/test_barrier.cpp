#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <thread>
#include <vector>

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
    EXPECT_NE(std::string(e.what()).find("token differs"), std::string::npos) << e.what();
  }
  lead.join();
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
      int fd = ::open(path.c_str(), O_RDWR);
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

TEST(LocalBarrier, AnUnterminatedAbortReasonIsReadWithinItsBuffer) {
  std::string path = shm_path("bar-reason");
  LocalBarrier owner = LocalBarrier::create(path, 2);
  LocalBarrier me = LocalBarrier::open(path, 0);
  int fd = ::open(path.c_str(), O_RDWR);
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
