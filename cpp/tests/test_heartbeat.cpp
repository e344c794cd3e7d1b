#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "../src/heartbeat_layout.hpp"
#include "elastic/heartbeat.hpp"
#include "test_util.hpp"

using elastic::Error;
using elastic::Heartbeat;
using elastic::HeartbeatTable;
using elastic_test::error_of;
using elastic_test::shm_path;

namespace {

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

}  // namespace

TEST(Heartbeat, CreateAttachBeatRead) {
  std::string path = shm_path("hb");
  {
    HeartbeatTable table = HeartbeatTable::create(path, 4);
    EXPECT_EQ(table.capacity(), 4u);
    EXPECT_TRUE(table.owner());
    EXPECT_EQ(table.read(2).state, ELASTIC_SLOT_EMPTY);

    Heartbeat hb = Heartbeat::attach(path, 2);
    elastic_slot_info info = table.read(2);
    EXPECT_EQ(info.state, ELASTIC_SLOT_ATTACHED);
    EXPECT_EQ(info.pid, ::getpid());
    EXPECT_EQ(info.last_beat_ns, 0u);

    uint64_t before = elastic::now_ns();
    hb.beat();
    hb.beat();
    info = table.read(2);
    EXPECT_EQ(info.state, ELASTIC_SLOT_BEATING);
    EXPECT_EQ(info.step, 2u);
    EXPECT_GE(info.last_beat_ns, before);
    EXPECT_LE(info.last_beat_ns, elastic::now_ns());

    hb.beat(100);
    EXPECT_EQ(table.read(2).step, 100u);
    hb.set_timeout_ms(750);
    EXPECT_EQ(table.read(2).timeout_ms, 750u);
    EXPECT_EQ(table.read(1).state, ELASTIC_SLOT_EMPTY);  // neighbours untouched

    hb.detach();
    EXPECT_EQ(table.read(2).state, ELASTIC_SLOT_DETACHED);

    uint64_t gen = table.generation();
    table.reset();
    EXPECT_EQ(table.generation(), gen + 1);
    EXPECT_EQ(table.read(2).state, ELASTIC_SLOT_EMPTY);
    EXPECT_EQ(table.read(2).step, 0u);
  }
  EXPECT_FALSE(exists(path)) << "the creator removes the file";
}

TEST(Heartbeat, ChildProcessBeatsParentReads) {
  std::string path = shm_path("hb-child");
  HeartbeatTable table = HeartbeatTable::create(path, 2);
  elastic_test::Child child([&] {
    Heartbeat hb = Heartbeat::attach(path, 1);
    for (int i = 0; i < 50; ++i) hb.beat();
    ::pause();
  });
  ASSERT_TRUE(elastic_test::eventually([&] { return table.read(1).step == 50; }, 5000));
  EXPECT_EQ(table.read(1).pid, child.pid());
}

TEST(Heartbeat, BadFilesAreClearErrors) {
  elastic_status st{};
  std::string missing = shm_path("missing");
  std::string msg = error_of([&] { Heartbeat::attach(missing, 0); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_BAD_FILE);
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;

  std::string foreign = shm_path("foreign");
  elastic_test::write_file(foreign, std::string(4096, 'x'));
  msg = error_of([&] { Heartbeat::attach(foreign, 0); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_BAD_FILE);
  EXPECT_NE(msg.find("not an elasticrun heartbeat table"), std::string::npos) << msg;
  ::unlink(foreign.c_str());

  std::string truncated = shm_path("truncated");
  elastic_test::write_file(truncated, "short");
  msg = error_of([&] { Heartbeat::attach(truncated, 0); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_BAD_FILE);
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  ::unlink(truncated.c_str());

  // A valid table cut short after its header.
  std::string cut = shm_path("cut");
  {
    HeartbeatTable t = HeartbeatTable::create(cut, 8);
    ASSERT_EQ(::truncate(cut.c_str(), 64 * 3), 0);
    msg = error_of([&] { Heartbeat::attach(cut, 0); }, &st);
    EXPECT_EQ(st, ELASTIC_ERR_BAD_FILE);
    EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  }

  // A table written by a future layout version.
  std::string future = shm_path("future");
  HeartbeatTable t = HeartbeatTable::create(future, 2);
  {
    int fd = ::open(future.c_str(), O_RDWR);
    uint32_t version = 99;
    ASSERT_EQ(::pwrite(fd, &version, sizeof(version), 8), static_cast<ssize_t>(sizeof(version)));
    ::close(fd);
  }
  msg = error_of([&] { Heartbeat::attach(future, 0); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_BAD_FILE);
  EXPECT_NE(msg.find("layout version 99"), std::string::npos) << msg;

  msg = error_of([&] { Heartbeat::attach("/dev", 0); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_BAD_FILE);
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
}

TEST(Heartbeat, BadArgumentsAreClearErrors) {
  elastic_status st{};
  std::string msg = error_of([&] { HeartbeatTable::create("relative/path", 2); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("'relative/path' is not absolute"), std::string::npos) << msg;

  msg = error_of([&] { HeartbeatTable::create(shm_path("zero"), 0); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("got 0"), std::string::npos) << msg;

  std::string path = shm_path("range");
  HeartbeatTable table = HeartbeatTable::create(path, 2);
  msg = error_of([&] { Heartbeat::attach(path, 2); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("slot 2 is out of range"), std::string::npos) << msg;
  msg = error_of([&] { table.read(7); }, &st);
  EXPECT_NE(msg.find("slot 7 is out of range"), std::string::npos) << msg;

  msg = error_of([&] { HeartbeatTable::create(path, 2); }, &st);
  EXPECT_EQ(st, ELASTIC_ERR_STATE);
  EXPECT_NE(msg.find("exists"), std::string::npos) << msg;
}

TEST(Heartbeat, FromEnvironment) {
  ::unsetenv(ELASTIC_ENV_HEARTBEAT_FILE);
  ::unsetenv(ELASTIC_ENV_HEARTBEAT_SLOT);
  EXPECT_FALSE(Heartbeat::from_env().has_value());

  std::string path = shm_path("env");
  HeartbeatTable table = HeartbeatTable::create(path, 3);
  ::setenv(ELASTIC_ENV_HEARTBEAT_FILE, path.c_str(), 1);
  ::setenv(ELASTIC_ENV_HEARTBEAT_SLOT, "1", 1);
  auto hb = Heartbeat::from_env();
  ASSERT_TRUE(hb.has_value());
  EXPECT_EQ(hb->slot(), 1u);
  hb->beat(7);
  EXPECT_EQ(table.read(1).step, 7u);

  ::setenv(ELASTIC_ENV_HEARTBEAT_SLOT, "one", 1);
  std::string msg = error_of([] { Heartbeat::from_env(); });
  EXPECT_NE(msg.find("ELASTIC_HEARTBEAT_SLOT='one' is not a slot index"), std::string::npos)
      << msg;
  ::setenv(ELASTIC_ENV_HEARTBEAT_SLOT, "-1", 1);
  msg = error_of([] { Heartbeat::from_env(); });
  EXPECT_NE(msg.find("'-1'"), std::string::npos) << msg;
  ::unsetenv(ELASTIC_ENV_HEARTBEAT_SLOT);
  msg = error_of([] { Heartbeat::from_env(); });
  EXPECT_NE(msg.find("is not"), std::string::npos) << msg;
  ::unsetenv(ELASTIC_ENV_HEARTBEAT_FILE);
}
