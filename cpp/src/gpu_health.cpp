#include "elastic/gpu_health.hpp"

#include <dlfcn.h>

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "nvml.hpp"
#include "util.hpp"

namespace elastic {
namespace {

constexpr const char* kDefaultLibrary = "libnvidia-ml.so.1";

// XIDs caused by the application (bad kernels, page faults), not by the hardware; NVIDIA's own
// Kubernetes device plugin skips the same ones.
bool application_xid(unsigned long long xid) {
  return xid == 13 || xid == 31 || xid == 43 || xid == 45 || xid == 68;
}

const char* xid_meaning(unsigned long long xid) {
  switch (xid) {
    case 48: return "double-bit ECC error";
    case 63: return "ECC page retirement or row remapping recorded";
    case 64: return "ECC page retirement or row remapping failed";
    case 74: return "NVLink error";
    case 79: return "GPU has fallen off the bus";
    case 92: return "high single-bit ECC error rate";
    case 94: return "contained ECC error";
    case 95: return "uncontained ECC error";
    case 119: return "GSP RPC timeout";
    case 120: return "GSP error";
    default: return "critical error";
  }
}

template <typename F>
void bind(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
}

}  // namespace

std::string gpu_fault_names(uint32_t faults) {
  static const std::pair<uint32_t, const char*> names[] = {
      {ELASTIC_GPU_FAULT_LOST, "lost"},
      {ELASTIC_GPU_FAULT_XID, "xid"},
      {ELASTIC_GPU_FAULT_ECC, "ecc"},
      {ELASTIC_GPU_FAULT_RETIRED_PAGES, "retired_pages"},
      {ELASTIC_GPU_FAULT_ROW_REMAP, "row_remap"},
      {ELASTIC_GPU_FAULT_THERMAL, "thermal"},
      {ELASTIC_GPU_FAULT_HW_SLOWDOWN, "hw_slowdown"}};
  std::string out;
  for (const auto& [bit, name] : names) {
    if (faults & bit) out += (out.empty() ? "" : ", ") + std::string(name);
  }
  return out;
}

// Shared between the caller's side and the NVML thread. The NVML thread keeps the Impl alive, so
// a thread stuck inside NVML can be abandoned safely.
struct GpuHealth::Impl : std::enable_shared_from_this<GpuHealth::Impl> {
  struct Job {
    std::string call;
    std::function<void()> fn;
  };

  // Guarded by `m`.
  std::mutex m;
  std::condition_variable cv;
  std::deque<Job> jobs;
  bool stopping = false;
  bool busy = false;
  std::string busy_call;
  uint64_t busy_since = 0;
  elastic_gpu_state state = ELASTIC_GPU_UNKNOWN;
  std::string detail;
  uint32_t count = 0;
  std::string path;
  std::thread thread;

  // Touched only on the NVML thread.
  void* lib = nullptr;
  nvml::Api api;
  bool initialised = false;
  std::vector<nvml::Device> devices;
  nvml::EventSet events = nullptr;
  std::vector<uint32_t> xid;  // per device: last critical XID seen (sticky)

  void loop() {
    std::unique_lock<std::mutex> lk(m);
    for (;;) {
      cv.wait(lk, [&] { return stopping || !jobs.empty(); });
      if (jobs.empty()) break;
      Job job = std::move(jobs.front());
      jobs.pop_front();
      busy = true;
      busy_call = job.call;
      busy_since = now_ns();
      lk.unlock();
      job.fn();
      lk.lock();
      busy = false;
      cv.notify_all();
    }
  }

  // Run `fn` on the NVML thread and wait at most `timeout_ms`. False if it did not finish in
  // time; `why` then says which call is stuck.
  bool run(const std::string& call, int timeout_ms, std::function<void()> fn, std::string* why) {
    auto done = std::make_shared<bool>(false);
    auto self = shared_from_this();
    std::unique_lock<std::mutex> lk(m);
    if (busy && timeout_ms >= 0 &&
        now_ns() - busy_since > static_cast<uint64_t>(timeout_ms) * 1000000ull) {
      *why = "NVML has not returned from " + busy_call + " for " +
             std::to_string((now_ns() - busy_since) / 1000000) + " ms";
      return false;
    }
    jobs.push_back({call, [self, done, fn = std::move(fn)] {
                      fn();
                      std::lock_guard<std::mutex> g(self->m);
                      *done = true;
                    }});
    cv.notify_all();
    auto pred = [&] { return *done; };
    if (timeout_ms < 0) {
      cv.wait(lk, pred);
    } else if (!cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), pred)) {
      *why = call + " did not return within " + std::to_string(timeout_ms) + " ms";
      return false;
    }
    return true;
  }

  std::string error_text(nvml::Return rc) const {
    const char* s = api.error_string != nullptr ? api.error_string(rc) : nullptr;
    return std::string(s != nullptr ? s : "unknown error") + " (NVML " + std::to_string(rc) + ")";
  }

  void set_state(elastic_gpu_state s, const std::string& d) {
    std::lock_guard<std::mutex> g(m);
    state = s;
    detail = d;
  }

  // On the NVML thread: load, resolve, initialise, enumerate.
  void load() {
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* err = dlerror();
      set_state(ELASTIC_GPU_NOT_AVAILABLE,
                "NVML library '" + path + "' could not be loaded (" + (err ? err : "?") +
                    "): no NVIDIA driver here, GPU checks are off");
      return;
    }
    bind(lib, "nvmlInit_v2", api.init);
    bind(lib, "nvmlShutdown", api.shutdown);
    bind(lib, "nvmlErrorString", api.error_string);
    bind(lib, "nvmlDeviceGetCount_v2", api.device_count);
    bind(lib, "nvmlDeviceGetHandleByIndex_v2", api.handle_by_index);
    bind(lib, "nvmlDeviceGetUUID", api.uuid);
    bind(lib, "nvmlDeviceGetTotalEccErrors", api.total_ecc);
    bind(lib, "nvmlDeviceGetRetiredPagesPendingStatus", api.pages_pending);
    bind(lib, "nvmlDeviceGetRemappedRows", api.remapped_rows);
    bind(lib, "nvmlDeviceGetCurrentClocksEventReasons", api.clock_reasons);
    if (api.clock_reasons == nullptr) {
      bind(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", api.clock_reasons);
    }
    bind(lib, "nvmlEventSetCreate", api.event_set_create);
    bind(lib, "nvmlDeviceRegisterEvents", api.register_events);
    bind(lib, "nvmlEventSetWait_v2", api.event_wait);
    bind(lib, "nvmlEventSetFree", api.event_set_free);
    if (api.init == nullptr || api.shutdown == nullptr || api.error_string == nullptr ||
        api.device_count == nullptr || api.handle_by_index == nullptr) {
      set_state(ELASTIC_GPU_NOT_AVAILABLE,
                "'" + path + "' lacks the NVML entry points nvmlInit_v2, nvmlShutdown, "
                "nvmlErrorString, nvmlDeviceGetCount_v2 or nvmlDeviceGetHandleByIndex_v2: it "
                "is not NVML, or too old; GPU checks are off");
      return;
    }
    nvml::Return rc = api.init();
    if (rc != nvml::kSuccess) {
      set_state(ELASTIC_GPU_NOT_AVAILABLE,
                "nvmlInit failed: " + error_text(rc) + "; GPU checks are off");
      return;
    }
    initialised = true;
    unsigned int n = 0;
    rc = api.device_count(&n);
    if (rc != nvml::kSuccess) {
      set_state(ELASTIC_GPU_UNKNOWN, "nvmlDeviceGetCount failed: " + error_text(rc));
      return;
    }
    devices.assign(n, nullptr);
    xid.assign(n, 0);
    for (unsigned int i = 0; i < n; ++i) api.handle_by_index(i, &devices[i]);
    if (api.event_set_create != nullptr && api.register_events != nullptr &&
        api.event_wait != nullptr && api.event_set_create(&events) == nvml::kSuccess) {
      for (unsigned int i = 0; i < n; ++i) {
        if (devices[i] != nullptr) {
          api.register_events(devices[i], nvml::kEventXidCriticalError, events);
        }
      }
    }
    std::lock_guard<std::mutex> g(m);
    count = n;
    state = ELASTIC_GPU_HEALTHY;
    detail = "NVML loaded from '" + path + "', " + std::to_string(n) + " device(s)";
  }

  // On the NVML thread: collect pending XID events (non-blocking).
  void drain_xid_events() {
    if (events == nullptr) return;
    for (int guard = 0; guard < 1024; ++guard) {
      nvml::EventData data{};
      if (api.event_wait(events, &data, 0) != nvml::kSuccess) return;
      if (!(data.event_type & nvml::kEventXidCriticalError) || application_xid(data.event_data)) {
        continue;
      }
      for (size_t i = 0; i < devices.size(); ++i) {
        if (devices[i] == data.device) xid[i] = static_cast<uint32_t>(data.event_data);
      }
    }
  }

  // On the NVML thread: every check of one device.
  void check_device(uint32_t index, GpuReport& r) {
    r.device = static_cast<int32_t>(index);
    r.state = ELASTIC_GPU_HEALTHY;
    std::string gpu = "GPU " + std::to_string(index);
    std::vector<std::string> notes;
    auto lost = [&](const char* call) {
      r.faults |= ELASTIC_GPU_FAULT_LOST;
      notes.push_back(gpu + " is lost (" + call + ": GPU is lost): it fell off the bus or "
                      "needs a reset");
    };
    nvml::Device dev = nullptr;
    nvml::Return rc = api.handle_by_index(index, &dev);
    if (rc == nvml::kErrorGpuIsLost) {
      lost("nvmlDeviceGetHandleByIndex");
    } else if (rc != nvml::kSuccess) {
      r.state = ELASTIC_GPU_UNKNOWN;
      notes.push_back(gpu + ": nvmlDeviceGetHandleByIndex failed: " + error_text(rc));
    } else {
      if (api.uuid != nullptr) {
        char uuid[96] = {};
        rc = api.uuid(dev, uuid, sizeof(uuid));
        if (rc == nvml::kErrorGpuIsLost) lost("nvmlDeviceGetUUID");
      }
      if (!(r.faults & ELASTIC_GPU_FAULT_LOST)) {
        drain_xid_events();
        if (index < xid.size() && xid[index] != 0) {
          r.faults |= ELASTIC_GPU_FAULT_XID;
          r.last_xid = xid[index];
          notes.push_back(gpu + " reported XID " + std::to_string(xid[index]) + " (" +
                          xid_meaning(xid[index]) + ")");
        }
        unsigned long long ecc = 0;
        if (api.total_ecc != nullptr &&
            api.total_ecc(dev, nvml::kMemoryErrorUncorrected, nvml::kVolatileEcc, &ecc) ==
                nvml::kSuccess &&
            ecc > 0) {
          r.faults |= ELASTIC_GPU_FAULT_ECC;
          r.ecc_uncorrected = ecc;
          notes.push_back(gpu + " has " + std::to_string(ecc) + " uncorrectable ECC error(s)");
        }
        int pending = 0;
        if (api.pages_pending != nullptr && api.pages_pending(dev, &pending) == nvml::kSuccess &&
            pending == nvml::kFeatureEnabled) {
          r.faults |= ELASTIC_GPU_FAULT_RETIRED_PAGES;
          notes.push_back(gpu + " has retired memory pages pending: it needs a reset");
        }
        unsigned int corr = 0, unc = 0, is_pending = 0, failure = 0;
        if (api.remapped_rows != nullptr &&
            api.remapped_rows(dev, &corr, &unc, &is_pending, &failure) == nvml::kSuccess &&
            (failure != 0 || is_pending != 0)) {
          r.faults |= ELASTIC_GPU_FAULT_ROW_REMAP;
          notes.push_back(gpu + (failure != 0 ? " failed to remap a memory row: replace or "
                                                "service the GPU"
                                              : " has a row remap pending: it needs a reset"));
        }
        unsigned long long reasons = 0;
        if (api.clock_reasons != nullptr && api.clock_reasons(dev, &reasons) == nvml::kSuccess) {
          if (reasons & (nvml::kReasonSwThermalSlowdown | nvml::kReasonHwThermalSlowdown)) {
            r.faults |= ELASTIC_GPU_FAULT_THERMAL;
            notes.push_back(gpu + " is slowed down by heat");
          }
          if (reasons & (nvml::kReasonHwSlowdown | nvml::kReasonHwPowerBrakeSlowdown)) {
            r.faults |= ELASTIC_GPU_FAULT_HW_SLOWDOWN;
            notes.push_back(gpu + " is in hardware slowdown (power brake or HW slowdown)");
          }
        }
      }
    }
    if (r.faults != 0) r.state = ELASTIC_GPU_UNHEALTHY;
    for (const auto& n : notes) r.detail += (r.detail.empty() ? "" : "; ") + n;
    if (r.detail.empty()) r.detail = gpu + " is healthy";
    r.time_ns = now_ns();
  }

  void unload() {
    if (events != nullptr && api.event_set_free != nullptr) api.event_set_free(events);
    events = nullptr;
    if (initialised) api.shutdown();
    initialised = false;
    if (lib != nullptr) dlclose(lib);
    lib = nullptr;
  }
};

std::shared_ptr<GpuHealth> GpuHealth::open(const std::string& library, int timeout_ms) {
  auto impl = std::make_shared<Impl>();
  if (!library.empty()) {
    impl->path = library;
  } else if (const char* env = std::getenv(ELASTIC_ENV_NVML_LIBRARY); env && *env) {
    impl->path = env;
  } else {
    impl->path = kDefaultLibrary;
  }
  impl->detail = "NVML is initialising";
  impl->thread = std::thread([impl] { impl->loop(); });
  std::string why;
  if (!impl->run("nvmlInit", timeout_ms, [p = impl.get()] { p->load(); }, &why)) {
    impl->set_state(ELASTIC_GPU_UNKNOWN,
                    why + " (library '" + impl->path + "'): the driver may be stuck");
  }
  return std::shared_ptr<GpuHealth>(new GpuHealth(std::move(impl)));
}

GpuHealth::~GpuHealth() {
  std::string why;
  bool idle = impl_->run("nvmlShutdown", 1000, [p = impl_.get()] { p->unload(); }, &why);
  {
    std::lock_guard<std::mutex> g(impl_->m);
    impl_->stopping = true;
    impl_->cv.notify_all();
  }
  if (idle) {
    impl_->thread.join();
  } else {
    impl_->thread.detach();  // stuck in NVML: it keeps the Impl alive and exits when it returns
  }
}

elastic_gpu_state GpuHealth::state() const {
  std::lock_guard<std::mutex> g(impl_->m);
  return impl_->state;
}

std::string GpuHealth::detail() const {
  std::lock_guard<std::mutex> g(impl_->m);
  return impl_->detail;
}

std::string GpuHealth::library_path() const { return impl_->path; }

uint32_t GpuHealth::device_count() const {
  std::lock_guard<std::mutex> g(impl_->m);
  return impl_->count;
}

GpuReport GpuHealth::check(uint32_t device, int timeout_ms) {
  GpuReport report;
  report.device = static_cast<int32_t>(device);
  elastic_gpu_state s = state();
  if (s != ELASTIC_GPU_HEALTHY) {
    report.state = s;
    report.detail = detail();
    report.time_ns = now_ns();
    return report;
  }
  if (device >= device_count()) {
    throw Error(ELASTIC_ERR_NOT_FOUND, "GPU " + std::to_string(device) + " does not exist: NVML "
                                           "reports " + std::to_string(device_count()) +
                                           " device(s)");
  }
  auto result = std::make_shared<GpuReport>();
  std::string why;
  if (!impl_->run("the checks of GPU " + std::to_string(device), timeout_ms,
                  [p = impl_.get(), result, device] { p->check_device(device, *result); },
                  &why)) {
    report.state = ELASTIC_GPU_UNKNOWN;
    report.detail = why;
    report.time_ns = now_ns();
    return report;
  }
  std::lock_guard<std::mutex> g(impl_->m);  // the job wrote *result before marking itself done
  return *result;
}

std::vector<GpuReport> GpuHealth::check_all(int timeout_ms) {
  const uint64_t deadline = detail::deadline_after_ms(timeout_ms);
  std::vector<GpuReport> out;
  uint32_t n = device_count();
  for (uint32_t i = 0; i < n; ++i) {
    int left = -1;
    if (deadline != UINT64_MAX) {
      uint64_t now = now_ns();
      left = now >= deadline ? 0 : static_cast<int>((deadline - now) / 1000000);
    }
    out.push_back(check(i, left));
  }
  return out;
}

}  // namespace elastic
