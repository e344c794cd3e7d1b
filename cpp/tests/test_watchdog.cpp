#include <gtest/gtest.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <vector>

#include "elastic/heartbeat.hpp"
#include "elastic/watchdog.hpp"
#include "test_util.hpp"

using elastic::Event;
using elastic::Heartbeat;
using elastic::HeartbeatTable;
using elastic::Watchdog;
using elastic::WatchdogOptions;
using elastic_test::Child;
using elastic_test::error_of;
using elastic_test::shm_path;

namespace {

WatchdogOptions with_mode(elastic_death_detection mode) {
  WatchdogOptions o;
  o.death_detection = mode;
  return o;
}

class DeathDetection : public ::testing::TestWithParam<elastic_death_detection> {};

}  // namespace

TEST_P(DeathDetection, SigkilledChildIsReportedExited) {
  Watchdog wd(with_mode(GetParam()));
  EXPECT_EQ(wd.death_detection(), GetParam());
  Child child([] { ::pause(); });
  wd.watch(3, child.pid());
  wd.start();
  uint64_t killed_at = elastic::now_ns();
  child.kill(SIGKILL);
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_EXITED);
  EXPECT_EQ(ev->worker, 3);
  EXPECT_EQ(ev->pid, child.pid());
  EXPECT_EQ(ev->signal, SIGKILL);
  EXPECT_EQ(ev->exit_code, -1);
  EXPECT_GE(ev->time_ns, killed_at);
  EXPECT_NE(ev->detail.find("SIGKILL"), std::string::npos) << ev->detail;
  EXPECT_EQ(wd.watched(), 0u) << "an exited worker is no longer watched";
  // WNOWAIT: the status is still there for the owner to reap.
  int status = child.wait();
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}

TEST_P(DeathDetection, ExitCodeIsReported) {
  Watchdog wd(with_mode(GetParam()));
  Child child([] { ::_exit(3); });
  wd.watch(0, child.pid());
  wd.start();
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_EXITED);
  EXPECT_EQ(ev->exit_code, 3);
  EXPECT_EQ(ev->signal, 0);
  EXPECT_NE(ev->detail.find("exited with code 3"), std::string::npos) << ev->detail;
}

INSTANTIATE_TEST_SUITE_P(Modes, DeathDetection,
                         ::testing::Values(ELASTIC_DEATH_PIDFD, ELASTIC_DEATH_POLL));

TEST(Watchdog, ReapOption) {
  WatchdogOptions o;
  o.reap = true;
  Watchdog wd(o);
  Child child([] { ::_exit(5); });
  pid_t pid = child.pid();
  wd.watch(0, pid);
  wd.start();
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->exit_code, 5);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, WNOHANG), -1) << "the watchdog reaped it";
  EXPECT_EQ(errno, ECHILD);
}

TEST(Watchdog, NonChildExitIsSeenWithUnknownStatus) {
  // A grandchild: the child forks it, reports its pid through a pipe, and stays alive.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  Child child([&] {
    pid_t g = ::fork();
    if (g == 0) {
      ::pause();
      ::_exit(0);
    }
    ssize_t rc = ::write(fds[1], &g, sizeof(g));
    (void)rc;
    int st;
    ::waitpid(g, &st, 0);
    ::pause();
  });
  pid_t grandchild = 0;
  ASSERT_EQ(::read(fds[0], &grandchild, sizeof(grandchild)),
            static_cast<ssize_t>(sizeof(grandchild)));
  ::close(fds[0]);
  ::close(fds[1]);
  Watchdog wd;
  wd.watch(1, grandchild);
  wd.start();
  ::kill(grandchild, SIGKILL);
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_EXITED);
  EXPECT_EQ(ev->pid, grandchild);
  EXPECT_NE(ev->detail.find("status is unknown"), std::string::npos) << ev->detail;
}

TEST(Watchdog, ChildThatStopsBeatingIsReportedHung) {
  std::string path = shm_path("hung");
  HeartbeatTable table = HeartbeatTable::create(path, 2);
  Child child([&] {
    Heartbeat hb = Heartbeat::attach(path, 1);
    for (int i = 0; i < 20; ++i) {
      hb.beat();
      ::usleep(5000);
    }
    ::pause();  // hang
  });
  Watchdog wd;
  wd.watch(7, child.pid(), &table, 1, /*hang_timeout_ms=*/200);
  wd.start();
  auto ev = wd.next_event(10000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_HUNG);
  EXPECT_EQ(ev->worker, 7);
  EXPECT_EQ(ev->step, 20u);
  elastic_slot_info info = table.read(1);
  EXPECT_GE(ev->time_ns - info.last_beat_ns, 200u * 1000000u);
  EXPECT_NE(ev->detail.find("has not beaten for"), std::string::npos) << ev->detail;
  // Reported once per hang, not on every check.
  EXPECT_FALSE(wd.next_event(400).has_value());
  child.kill();
  ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_EXITED);
}

TEST(Watchdog, WorkerThatNeverBeatsIsOnlyCheckedForLiveness) {
  std::string path = shm_path("silent");
  HeartbeatTable table = HeartbeatTable::create(path, 1);
  Child child([&] {
    Heartbeat hb = Heartbeat::attach(path, 0);
    ::pause();
  });
  WatchdogOptions o;
  o.default_hang_timeout_ms = 50;
  Watchdog wd(o);
  wd.watch(0, child.pid(), &table, 0);
  wd.start();
  EXPECT_FALSE(wd.next_event(300).has_value());
  child.kill();
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_EXITED);
}

TEST(Watchdog, WorkersOwnTimeoutWins) {
  std::string path = shm_path("own");
  HeartbeatTable table = HeartbeatTable::create(path, 1);
  Child child([&] {
    Heartbeat hb = Heartbeat::attach(path, 0);
    hb.set_timeout_ms(60000);  // e.g. a long checkpoint ahead
    hb.beat();
    ::pause();
  });
  Watchdog wd;
  wd.watch(0, child.pid(), &table, 0, /*hang_timeout_ms=*/50);
  wd.start();
  ASSERT_TRUE(elastic_test::eventually([&] { return table.read(0).step == 1; }, 5000));
  EXPECT_FALSE(wd.next_event(300).has_value());
}

TEST(Watchdog, HangTimeoutCanBeChangedWhileWatching) {
  std::string path = shm_path("change");
  HeartbeatTable table = HeartbeatTable::create(path, 1);
  Child child([&] {
    Heartbeat hb = Heartbeat::attach(path, 0);
    hb.beat();
    ::pause();
  });
  Watchdog wd;
  wd.watch(0, child.pid(), &table, 0, /*hang_timeout_ms=*/60000);
  wd.start();
  ASSERT_TRUE(elastic_test::eventually([&] { return table.read(0).step == 1; }, 5000));
  EXPECT_FALSE(wd.next_event(200).has_value());
  EXPECT_TRUE(wd.set_hang_timeout(0, 50));
  EXPECT_FALSE(wd.set_hang_timeout(9, 50));
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_HUNG);
  EXPECT_NE(ev->detail.find("timeout 50 ms"), std::string::npos) << ev->detail;
}

TEST(Watchdog, CallbackAndQueueBothReceiveEvents) {
  std::mutex m;
  std::vector<Event> seen;
  Watchdog wd;
  wd.set_callback([&](const Event& ev) {
    std::lock_guard<std::mutex> g(m);
    seen.push_back(ev);
  });
  Child a([] { ::_exit(1); });
  Child b([] { ::_exit(2); });
  wd.watch(0, a.pid());
  wd.watch(1, b.pid());
  wd.start();
  ASSERT_TRUE(wd.next_event(5000).has_value());
  ASSERT_TRUE(wd.next_event(5000).has_value());
  std::lock_guard<std::mutex> g(m);
  ASSERT_EQ(seen.size(), 2u);
}

TEST(Watchdog, StartStopLeakNothing) {
  std::string path = shm_path("leak");
  int fds_before = elastic_test::open_fds();
  int threads_before = elastic_test::thread_count();
  for (int round = 0; round < 5; ++round) {
    HeartbeatTable table = HeartbeatTable::create(path, 2);
    Child child([] { ::pause(); });
    Watchdog wd;
    wd.watch(0, child.pid(), &table, 0, 1000);
    wd.start();
    EXPECT_GT(elastic_test::thread_count(), threads_before);
    wd.stop();
    wd.start();  // restartable
    child.kill();
    ASSERT_TRUE(wd.next_event(5000).has_value());
    wd.stop();
  }
  EXPECT_EQ(elastic_test::open_fds(), fds_before);
  // pthread_join returns once the kernel clears the thread's tid, a moment before its
  // /proc/self/task entry goes: wait for the entries to go; a leaked thread never does.
  EXPECT_TRUE(elastic_test::eventually(
      [&] { return elastic_test::thread_count() == threads_before; }, 5000))
      << elastic_test::thread_count() << " threads, " << threads_before << " before";
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

TEST(Watchdog, BadArgumentsAreClearErrors) {
  Watchdog wd;
  auto message = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const elastic::Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message([&] { wd.watch(-1, ::getpid()); }).find("worker id -1 is negative"),
            std::string::npos);
  EXPECT_NE(message([&] { wd.watch(0, 0); }).find("pid 0 is not a process id"),
            std::string::npos);
  EXPECT_NE(message([&] { wd.watch(0, ::getpid(), nullptr, 2); }).find("without a heartbeat"),
            std::string::npos);
  // A pid that no longer exists (reaped child).
  pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  int st;
  ::waitpid(gone, &st, 0);
  std::string msg = message([&] { wd.watch(0, gone); });
  EXPECT_NE(msg.find("no process with pid " + std::to_string(gone)), std::string::npos) << msg;
  wd.watch(0, ::getpid());
  EXPECT_NE(message([&] { wd.watch(0, ::getpid()); }).find("already watched"),
            std::string::npos);
  EXPECT_TRUE(wd.unwatch(0));
  EXPECT_FALSE(wd.unwatch(0));
  wd.start();
  EXPECT_NE(message([&] { wd.start(); }).find("already running"), std::string::npos);
}

TEST(Process, DieWithParent) {
  // A child whose own child asked to die with it: killing the child ends the grandchild.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  Child middle([&] {
    pid_t me = ::getpid();
    pid_t g = ::fork();
    if (g == 0) {
      elastic::die_with_parent(SIGKILL, me);
      ::pause();
      ::_exit(0);
    }
    ssize_t rc = ::write(fds[1], &g, sizeof(g));
    (void)rc;
    ::pause();
  });
  pid_t grandchild = 0;
  ASSERT_EQ(::read(fds[0], &grandchild, sizeof(grandchild)),
            static_cast<ssize_t>(sizeof(grandchild)));
  ::close(fds[0]);
  ::close(fds[1]);
  ::usleep(50000);  // let it call prctl
  Watchdog wd;
  wd.watch(0, grandchild);
  wd.start();
  middle.kill();
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_EXITED);
  EXPECT_EQ(ev->pid, grandchild);
  try {
    elastic::die_with_parent(SIGKILL, 1);  // our parent is not init
    FAIL() << "expected NOT_FOUND";
  } catch (const elastic::Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_NOT_FOUND);
  }
  ::prctl(PR_SET_PDEATHSIG, 0);
}

TEST(Watchdog, NextEventReturnsWhenStopped) {
  Watchdog wd;
  wd.start();
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    wd.stop();
  });
  EXPECT_FALSE(wd.next_event(-1).has_value());
  stopper.join();
}

// A worker maps the table read-write: whatever it does to the file (write zeros, all ones or
// random bytes over it, cut it, grow it, unlink it, put another file at its path) must never
// crash the supervisor, which never maps it: the watchdog reports that worker's heartbeat as
// broken, and reset() gives the next worker a good table at the same path.
enum Attack { kZeros, kOnes, kRandom, kTruncate, kGrow, kUnlink, kReplace, kFuture, kTimeout };

// Slot 1's last_beat_ns and timeout_ms, at their offsets in the layout.
constexpr off_t kSlot1 = 64 + 64;

void attack(const std::string& path, int how) {
  if (how == kFuture || how == kTimeout) {
    int fd = ::open(path.c_str(), O_RDWR);
    uint64_t v = how == kFuture ? elastic::now_ns() + 3600ull * 1000000000ull : ~0ull;
    (void)::pwrite(fd, &v, sizeof v, kSlot1 + (how == kFuture ? 16 : 24));
    ::close(fd);
    return;
  }
  if (how == kTruncate) {
    (void)::truncate(path.c_str(), 0);
    return;
  }
  if (how == kGrow) {
    (void)::truncate(path.c_str(), 1 << 20);
    return;
  }
  if (how == kUnlink || how == kReplace) {
    ::unlink(path.c_str());
    if (how == kReplace) {
      int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      (void)::ftruncate(fd, 4096);
      ::close(fd);
    }
    return;
  }
  int fd = ::open(path.c_str(), O_RDWR);
  std::vector<unsigned char> junk(4096);
  unsigned seed = 12345;
  for (auto& b : junk) {
    seed = seed * 1103515245u + 12345u;
    b = how == kZeros ? 0x00 : how == kOnes ? 0xff : static_cast<unsigned char>(seed >> 16);
  }
  (void)::pwrite(fd, junk.data(), junk.size(), 0);
  ::close(fd);
}

class Attacked : public ::testing::TestWithParam<int> {};

TEST_P(Attacked, AWorkerBreakingTheTableIsReportedAndTheSupervisorLives) {
  std::string path = shm_path("attacked");
  HeartbeatTable table = HeartbeatTable::create(path, 2);
  const int how = GetParam();
  Child child([&] {
    Heartbeat hb = Heartbeat::attach(path, 1);
    hb.beat();
    attack(path, how);
    for (int i = 0; i < 4000; ++i) ::usleep(5000);  // ended by the test
    ::_exit(3);
  });
  Watchdog wd;
  wd.watch(1, child.pid(), &table, 1, /*hang_timeout_ms=*/300);
  wd.start();
  auto ev = wd.next_event(20000);
  ASSERT_TRUE(ev.has_value());
  const bool still_readable = how == kUnlink || how == kGrow || how == kReplace;
  if (still_readable) {  // what the supervisor holds is intact: the silence is a hang
    EXPECT_EQ(ev->kind, ELASTIC_EVENT_HUNG) << ev->detail;
    EXPECT_NO_THROW(table.read(1));
  } else {  // every pattern breaks the header's magic or the size: caught at the next check
    EXPECT_EQ(ev->kind, ELASTIC_EVENT_BAD_HEARTBEAT) << ev->detail;
    EXPECT_NE(ev->detail.find("heartbeat cannot be trusted"), std::string::npos) << ev->detail;
    EXPECT_NE(ev->detail.find(path), std::string::npos) << ev->detail;
    std::string msg = error_of([&] { table.read(1); });
    const char* says = how == kTruncate ? "truncated to 0 bytes"
                       : how == kFuture ? "in the future"
                       : how == kTimeout ? "longer than the 604800000 ms a worker may set"
                                         : "overwritten";
    EXPECT_NE(msg.find(says), std::string::npos) << msg;
  }
  ::kill(child.pid(), SIGKILL);
  table.reset();  // heals: the header, the size, the file at the path
  EXPECT_EQ(table.read(0).state, ELASTIC_SLOT_EMPTY);
  EXPECT_EQ(table.read(1).state, ELASTIC_SLOT_EMPTY);
  Heartbeat next = Heartbeat::attach(path, 1);  // the next worker attaches to a good table
  next.beat(7);
  EXPECT_EQ(table.read(1).step, 7u);
  EXPECT_EQ(table.read(1).state, ELASTIC_SLOT_BEATING);
  wd.stop();
}

std::string attack_name(const ::testing::TestParamInfo<int>& info) {
  static const char* const names[] = {"Zeros",   "Ones",    "Random", "Truncate", "Grow",
                                      "Unlink",  "Replace", "Future", "Timeout"};
  return names[info.param];
}

INSTANTIATE_TEST_SUITE_P(Attacks, Attacked,
                         ::testing::Values(kZeros, kOnes, kRandom, kTruncate, kGrow, kUnlink,
                                           kReplace, kFuture, kTimeout),
                         attack_name);
