// GPU health against the fake libnvidia-ml.so.1 built beside this test (FAKE_NVML_PATH), loaded
// through the real dlopen path. Each test scripts the fake's answers in a file.
#include <gtest/gtest.h>
#include <unistd.h>

#include "elastic/gpu_health.hpp"
#include "elastic/watchdog.hpp"
#include "test_util.hpp"

using elastic::GpuHealth;
using elastic::GpuReport;

namespace {

class GpuHealthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    script_ = elastic_test::shm_path("nvml-script");
    ::setenv("ELASTIC_FAKE_NVML_SCRIPT", script_.c_str(), 1);
    ::unsetenv(ELASTIC_ENV_NVML_LIBRARY);
  }
  void TearDown() override {
    ::unlink(script_.c_str());
    ::unsetenv("ELASTIC_FAKE_NVML_SCRIPT");
  }
  void script(const std::string& text) { elastic_test::write_file(script_, text); }
  std::shared_ptr<GpuHealth> open(int timeout_ms = 2000) {
    return GpuHealth::open(FAKE_NVML_PATH, timeout_ms);
  }
  std::string script_;
};

}  // namespace

TEST_F(GpuHealthTest, MissingLibraryIsNotAvailableNotAnError) {
  auto gpu = GpuHealth::open("/nonexistent/libnvidia-ml.so.1");
  EXPECT_EQ(gpu->state(), ELASTIC_GPU_NOT_AVAILABLE);
  EXPECT_NE(gpu->detail().find("/nonexistent/libnvidia-ml.so.1"), std::string::npos);
  EXPECT_EQ(gpu->device_count(), 0u);
  EXPECT_EQ(gpu->check(0, 100).state, ELASTIC_GPU_NOT_AVAILABLE);
}

TEST_F(GpuHealthTest, EnvironmentVariableChoosesTheLibrary) {
  ::setenv(ELASTIC_ENV_NVML_LIBRARY, FAKE_NVML_PATH, 1);
  auto gpu = GpuHealth::open();
  EXPECT_EQ(gpu->library_path(), FAKE_NVML_PATH);
  EXPECT_EQ(gpu->state(), ELASTIC_GPU_HEALTHY);
  ::unsetenv(ELASTIC_ENV_NVML_LIBRARY);
}

TEST_F(GpuHealthTest, Healthy) {
  script("devices 3\n");
  auto gpu = open();
  ASSERT_EQ(gpu->state(), ELASTIC_GPU_HEALTHY) << gpu->detail();
  EXPECT_EQ(gpu->device_count(), 3u);
  for (const GpuReport& r : gpu->check_all(2000)) {
    EXPECT_EQ(r.state, ELASTIC_GPU_HEALTHY) << r.detail;
    EXPECT_EQ(r.faults, 0u);
  }
}

TEST_F(GpuHealthTest, DeviceOutOfRangeIsAnError) {
  auto gpu = open();
  try {
    gpu->check(5, 1000);
    FAIL() << "expected an error";
  } catch (const elastic::Error& e) {
    EXPECT_EQ(e.status(), ELASTIC_ERR_NOT_FOUND);
    EXPECT_NE(std::string(e.what()).find("GPU 5 does not exist"), std::string::npos);
  }
}

TEST_F(GpuHealthTest, InitFailureIsNotAvailable) {
  script("init_fail 9\n");
  auto gpu = open();
  EXPECT_EQ(gpu->state(), ELASTIC_GPU_NOT_AVAILABLE);
  EXPECT_NE(gpu->detail().find("Driver Not Loaded"), std::string::npos) << gpu->detail();
}

struct FaultCase {
  const char* script;
  uint32_t device;
  uint32_t fault;
  const char* detail;
};

class GpuFaults : public GpuHealthTest, public ::testing::WithParamInterface<FaultCase> {};

TEST_P(GpuFaults, AreReported) {
  const FaultCase& c = GetParam();
  script("devices 2\n");
  auto gpu = open();
  ASSERT_EQ(gpu->state(), ELASTIC_GPU_HEALTHY) << gpu->detail();
  script(std::string("devices 2\n") + c.script + "\n");
  GpuReport r = gpu->check(c.device, 2000);
  EXPECT_EQ(r.state, ELASTIC_GPU_UNHEALTHY) << r.detail;
  EXPECT_EQ(r.faults & c.fault, c.fault) << r.detail;
  EXPECT_NE(r.detail.find(c.detail), std::string::npos) << r.detail;
  GpuReport other = gpu->check(1 - c.device, 2000);
  EXPECT_EQ(other.state, ELASTIC_GPU_HEALTHY) << other.detail;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuFaults,
    ::testing::Values(FaultCase{"lost 1", 1, ELASTIC_GPU_FAULT_LOST, "GPU 1 is lost"},
                      FaultCase{"xid 79 0", 0, ELASTIC_GPU_FAULT_XID,
                                "XID 79 (GPU has fallen off the bus)"},
                      FaultCase{"ecc 4 0", 0, ELASTIC_GPU_FAULT_ECC,
                                "4 uncorrectable ECC error"},
                      FaultCase{"remap_failure 1", 1, ELASTIC_GPU_FAULT_ROW_REMAP,
                                "failed to remap"},
                      FaultCase{"remap_pending 0", 0, ELASTIC_GPU_FAULT_ROW_REMAP,
                                "row remap pending"},
                      FaultCase{"retired 0", 0, ELASTIC_GPU_FAULT_RETIRED_PAGES,
                                "retired memory pages pending"},
                      FaultCase{"thermal 1", 1, ELASTIC_GPU_FAULT_THERMAL, "heat"},
                      FaultCase{"hw_slowdown 0", 0, ELASTIC_GPU_FAULT_HW_SLOWDOWN,
                                "hardware slowdown"}),
    [](const ::testing::TestParamInfo<FaultCase>& info) {
      std::string name = info.param.script;
      for (char& c : name) {
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

TEST_F(GpuHealthTest, XidIsStickyAndApplicationXidsAreIgnored) {
  auto gpu = open();
  script("xid 13 0\n");  // an application error: not a GPU fault
  EXPECT_EQ(gpu->check(0, 2000).state, ELASTIC_GPU_HEALTHY);
  gpu = nullptr;
  gpu = open();
  script("xid 48 0\n");
  EXPECT_EQ(gpu->check(0, 2000).last_xid, 48u);
  script("");  // the event was delivered once; the fault stays
  GpuReport r = gpu->check(0, 2000);
  EXPECT_EQ(r.state, ELASTIC_GPU_UNHEALTHY);
  EXPECT_EQ(r.last_xid, 48u);
}

TEST_F(GpuHealthTest, InitThatNeverReturnsDoesNotBlock) {
  script("init_hang 1500\n");
  uint64_t t0 = elastic::now_ns();
  auto gpu = open(/*timeout_ms=*/200);
  uint64_t waited_ms = (elastic::now_ns() - t0) / 1000000;
  EXPECT_LT(waited_ms, 1200u) << "open() must give up after its timeout";
  EXPECT_EQ(gpu->state(), ELASTIC_GPU_UNKNOWN);
  EXPECT_NE(gpu->detail().find("nvmlInit did not return within 200 ms"), std::string::npos)
      << gpu->detail();
  GpuReport r = gpu->check(0, 100);
  EXPECT_EQ(r.state, ELASTIC_GPU_UNKNOWN);
  // Once the stuck call returns, NVML becomes usable.
  ASSERT_TRUE(elastic_test::eventually(
      [&] { return gpu->state() == ELASTIC_GPU_HEALTHY; }, 5000));
  script("");
  EXPECT_EQ(gpu->check(0, 2000).state, ELASTIC_GPU_HEALTHY);
}

TEST_F(GpuHealthTest, QueryThatHangsGivesUnknownInTime) {
  auto gpu = open();
  ASSERT_EQ(gpu->state(), ELASTIC_GPU_HEALTHY);
  script("query_hang 1500\n");
  uint64_t t0 = elastic::now_ns();
  GpuReport r = gpu->check(0, 150);
  EXPECT_LT((elastic::now_ns() - t0) / 1000000, 1000u);
  EXPECT_EQ(r.state, ELASTIC_GPU_UNKNOWN);
  EXPECT_NE(r.detail.find("did not return within 150 ms"), std::string::npos) << r.detail;
  script("");
}

TEST_F(GpuHealthTest, WatchdogReportsGpuFaultsForTheWorkersOnThatGpu) {
  elastic::WatchdogOptions o;
  o.gpu_check_interval_ms = 20;
  elastic::Watchdog wd(o);
  wd.set_gpu_health(open());
  elastic_test::Child child([] { ::pause(); });
  wd.watch(4, child.pid(), nullptr, -1, 0, /*gpu=*/1);
  wd.start();
  EXPECT_FALSE(wd.next_event(100).has_value());
  script("lost 1\n");
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_GPU_UNHEALTHY);
  EXPECT_EQ(ev->worker, 4);
  EXPECT_EQ(ev->gpu, 1);
  EXPECT_NE(ev->detail.find("lost"), std::string::npos) << ev->detail;
  EXPECT_FALSE(wd.next_event(150).has_value()) << "reported once, not on every check";
}

TEST_F(GpuHealthTest, StuckNvmlNeverDelaysDeathDetection) {
  elastic::WatchdogOptions o;
  o.gpu_check_interval_ms = 10;
  o.gpu_check_timeout_ms = 100;
  elastic::Watchdog wd(o);
  wd.set_gpu_health(open());
  script("query_hang 1000\n");
  elastic_test::Child child([] { ::pause(); });
  wd.watch(0, child.pid());
  wd.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // NVML is now stuck
  uint64_t t0 = elastic::now_ns();
  child.kill();
  auto ev = wd.next_event(5000);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->kind, ELASTIC_EVENT_EXITED);
  EXPECT_LT((ev->time_ns - t0) / 1000000, 500u);
  script("");
}
