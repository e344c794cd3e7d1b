// The C API: thin wrappers that turn C++ exceptions into status codes and a per-thread message.
#include <cstddef>
#include <cstring>
#include <new>
#include <string>

#include "elastic/barrier.hpp"
#include "elastic/elastic.h"
#include "elastic/gpu_health.hpp"
#include "elastic/heartbeat.hpp"
#include "elastic/watchdog.hpp"
#include "util.hpp"

#ifndef ELASTIC_VERSION_STRING
#error "ELASTIC_VERSION_STRING must be defined by the build"
#endif

struct elastic_heartbeat_table {
  elastic::HeartbeatTable table;
};
struct elastic_heartbeat {
  elastic::Heartbeat hb;
};
struct elastic_gpu_health {
  std::shared_ptr<elastic::GpuHealth> gpu;
  std::string detail;
};
struct elastic_barrier {
  elastic::LocalBarrier barrier;
};
struct elastic_tcp_barrier {
  elastic::TcpBarrier barrier;
};
struct elastic_watchdog {
  elastic::Watchdog watchdog;
};

namespace {

thread_local std::string g_last_error;

int fail(int status, const std::string& message) {
  g_last_error = message;
  return status;
}

template <typename F>
int guard(F&& fn) {
  try {
    fn();
    return ELASTIC_OK;
  } catch (const elastic::Error& e) {
    return fail(e.status(), e.what());
  } catch (const std::bad_alloc&) {
    return fail(ELASTIC_ERR_SYSTEM, "out of memory");
  } catch (const std::exception& e) {
    return fail(ELASTIC_ERR_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return fail(ELASTIC_ERR_INTERNAL, "internal error: unknown exception");
  }
}

#define ELASTIC_REQUIRE(ptr, name)                                                       \
  do {                                                                                   \
    if ((ptr) == nullptr)                                                                \
      return fail(ELASTIC_ERR_INVALID_ARGUMENT, std::string(name) + " must not be NULL"); \
  } while (0)

void to_c(const elastic::Event& ev, elastic_event* out) {
  out->worker = ev.worker;
  out->kind = ev.kind;
  out->time_ns = ev.time_ns;
  out->pid = ev.pid;
  out->exit_code = ev.exit_code;
  out->signal = ev.signal;
  out->gpu = ev.gpu;
  out->step = ev.step;
  elastic::detail::copy_string(out->detail, sizeof(out->detail), ev.detail);
}

// A caller compiled against an older elastic.h passes a smaller struct: only the fields that
// fit in its struct_size are read, the others keep their defaults. A size that ends inside a
// field, or one larger than this library knows, cannot be read safely.
elastic::WatchdogOptions from_c(const elastic_watchdog_options* o) {
  elastic::WatchdogOptions opt;
  if (o == nullptr) return opt;
  const size_t size = o->struct_size;
  struct Field {
    const char* name;
    size_t offset;
    size_t size;
  };
#define ELASTIC_FIELD(f) \
  Field { #f, offsetof(elastic_watchdog_options, f), sizeof(o->f) }
  const Field fields[] = {
      ELASTIC_FIELD(struct_size),          ELASTIC_FIELD(default_hang_timeout_ms),
      ELASTIC_FIELD(hang_check_interval_ms), ELASTIC_FIELD(death_detection),
      ELASTIC_FIELD(poll_interval_ms),      ELASTIC_FIELD(reap),
      ELASTIC_FIELD(gpu_check_interval_ms), ELASTIC_FIELD(gpu_check_timeout_ms),
      ELASTIC_FIELD(queue_capacity),
  };
#undef ELASTIC_FIELD
  if (size < sizeof(uint32_t) || size > sizeof(elastic_watchdog_options)) {
    throw elastic::Error(
        ELASTIC_ERR_INVALID_ARGUMENT,
        "elastic_watchdog_options.struct_size is " + std::to_string(size) +
            (size > sizeof(elastic_watchdog_options)
                 ? ", larger than this library's " + std::to_string(sizeof(elastic_watchdog_options)) +
                       " bytes (the caller was built against a newer elastic.h): link the "
                       "library it was built for, or rebuild against this one"
                 : ": initialise the struct with elastic_watchdog_options_init"));
  }
  for (const Field& f : fields) {
    if (f.offset < size && f.offset + f.size > size) {
      throw elastic::Error(ELASTIC_ERR_INVALID_ARGUMENT,
                           "elastic_watchdog_options.struct_size is " + std::to_string(size) +
                               ", which ends inside the field " + f.name +
                               ": initialise the struct with elastic_watchdog_options_init");
    }
  }
  auto has = [&](size_t offset, size_t field_size) { return offset + field_size <= size; };
#define ELASTIC_HAS(f) has(offsetof(elastic_watchdog_options, f), sizeof(o->f))
  if (ELASTIC_HAS(default_hang_timeout_ms)) opt.default_hang_timeout_ms = o->default_hang_timeout_ms;
  if (ELASTIC_HAS(hang_check_interval_ms)) opt.hang_check_interval_ms = o->hang_check_interval_ms;
  if (ELASTIC_HAS(death_detection))
    opt.death_detection = static_cast<elastic_death_detection>(o->death_detection);
  if (ELASTIC_HAS(poll_interval_ms)) opt.poll_interval_ms = o->poll_interval_ms == 0 ? 5 : o->poll_interval_ms;
  if (ELASTIC_HAS(reap)) opt.reap = o->reap != 0;
  if (ELASTIC_HAS(gpu_check_interval_ms)) opt.gpu_check_interval_ms = o->gpu_check_interval_ms;
  if (ELASTIC_HAS(gpu_check_timeout_ms)) opt.gpu_check_timeout_ms = o->gpu_check_timeout_ms;
  if (ELASTIC_HAS(queue_capacity)) opt.queue_capacity = o->queue_capacity;
#undef ELASTIC_HAS
  return opt;
}

}  // namespace

extern "C" {

int elastic_abi_version(void) { return ELASTIC_ABI_VERSION; }
const char* elastic_version(void) { return ELASTIC_VERSION_STRING; }
const char* elastic_last_error(void) { return g_last_error.c_str(); }
uint64_t elastic_now_ns(void) { return elastic::now_ns(); }

const char* elastic_status_name(int status) {
  switch (status) {
    case ELASTIC_OK: return "ELASTIC_OK";
    case ELASTIC_ERR_INVALID_ARGUMENT: return "ELASTIC_ERR_INVALID_ARGUMENT";
    case ELASTIC_ERR_SYSTEM: return "ELASTIC_ERR_SYSTEM";
    case ELASTIC_ERR_BAD_FILE: return "ELASTIC_ERR_BAD_FILE";
    case ELASTIC_ERR_TIMEOUT: return "ELASTIC_ERR_TIMEOUT";
    case ELASTIC_ERR_ABORTED: return "ELASTIC_ERR_ABORTED";
    case ELASTIC_ERR_NOT_FOUND: return "ELASTIC_ERR_NOT_FOUND";
    case ELASTIC_ERR_STATE: return "ELASTIC_ERR_STATE";
    case ELASTIC_ERR_NETWORK: return "ELASTIC_ERR_NETWORK";
    case ELASTIC_ERR_NOT_AVAILABLE: return "ELASTIC_ERR_NOT_AVAILABLE";
    case ELASTIC_ERR_INTERNAL: return "ELASTIC_ERR_INTERNAL";
    default: return "ELASTIC_ERR_UNKNOWN_STATUS";
  }
}

const char* elastic_event_kind_name(int kind) {
  switch (kind) {
    case ELASTIC_EVENT_EXITED: return "EXITED";
    case ELASTIC_EVENT_HUNG: return "HUNG";
    case ELASTIC_EVENT_GPU_UNHEALTHY: return "GPU_UNHEALTHY";
    case ELASTIC_EVENT_BAD_HEARTBEAT: return "BAD_HEARTBEAT";
    default: return "UNKNOWN";
  }
}

// ---- heartbeat ------------------------------------------------------------------------------

int elastic_heartbeat_table_create(const char* path, uint32_t slots,
                                   elastic_heartbeat_table** out) {
  ELASTIC_REQUIRE(path, "path");
  ELASTIC_REQUIRE(out, "out");
  return guard([&] {
    *out = new elastic_heartbeat_table{elastic::HeartbeatTable::create(path, slots)};
  });
}

int elastic_heartbeat_table_open(const char* path, elastic_heartbeat_table** out) {
  ELASTIC_REQUIRE(path, "path");
  ELASTIC_REQUIRE(out, "out");
  return guard([&] { *out = new elastic_heartbeat_table{elastic::HeartbeatTable::open(path)}; });
}

void elastic_heartbeat_table_destroy(elastic_heartbeat_table* table) { delete table; }

uint32_t elastic_heartbeat_table_capacity(const elastic_heartbeat_table* table) {
  return table != nullptr ? table->table.capacity() : 0;
}

uint64_t elastic_heartbeat_table_generation(const elastic_heartbeat_table* table) {
  return table != nullptr ? table->table.generation() : 0;
}

int elastic_heartbeat_table_read(const elastic_heartbeat_table* table, uint32_t slot,
                                 elastic_slot_info* out) {
  ELASTIC_REQUIRE(table, "table");
  ELASTIC_REQUIRE(out, "out");
  return guard([&] { *out = table->table.read(slot); });
}

int elastic_heartbeat_table_reset_slot(elastic_heartbeat_table* table, uint32_t slot) {
  ELASTIC_REQUIRE(table, "table");
  return guard([&] { table->table.reset_slot(slot); });
}

int elastic_heartbeat_table_reset(elastic_heartbeat_table* table) {
  ELASTIC_REQUIRE(table, "table");
  return guard([&] { table->table.reset(); });
}

int elastic_heartbeat_create(const char* path, uint32_t slot, elastic_heartbeat** out) {
  ELASTIC_REQUIRE(path, "path");
  ELASTIC_REQUIRE(out, "out");
  return guard([&] { *out = new elastic_heartbeat{elastic::Heartbeat::attach(path, slot)}; });
}

int elastic_heartbeat_create_from_env(elastic_heartbeat** out) {
  ELASTIC_REQUIRE(out, "out");
  int status = ELASTIC_OK;
  int rc = guard([&] {
    auto hb = elastic::Heartbeat::from_env();
    if (!hb) {
      status = fail(ELASTIC_ERR_NOT_FOUND, std::string(ELASTIC_ENV_HEARTBEAT_FILE) +
                                               " is not set: this process was not started by "
                                               "a launcher that watches heartbeats");
      return;
    }
    *out = new elastic_heartbeat{std::move(*hb)};
  });
  return rc != ELASTIC_OK ? rc : status;
}

void elastic_heartbeat_destroy(elastic_heartbeat* hb) { delete hb; }
void elastic_heartbeat_beat(elastic_heartbeat* hb) { hb->hb.beat(); }
void elastic_heartbeat_beat_step(elastic_heartbeat* hb, uint64_t step) { hb->hb.beat(step); }
void elastic_heartbeat_set_timeout(elastic_heartbeat* hb, uint64_t timeout_ms) {
  hb->hb.set_timeout_ms(timeout_ms);
}
uint32_t elastic_heartbeat_slot(const elastic_heartbeat* hb) { return hb->hb.slot(); }

// ---- GPU health -----------------------------------------------------------------------------

int elastic_gpu_health_create(const char* library, int timeout_ms, elastic_gpu_health** out) {
  ELASTIC_REQUIRE(out, "out");
  return guard([&] {
    *out = new elastic_gpu_health{elastic::GpuHealth::open(library ? library : "", timeout_ms),
                                  {}};
  });
}

void elastic_gpu_health_destroy(elastic_gpu_health* gpu) { delete gpu; }

int elastic_gpu_health_state(const elastic_gpu_health* gpu) {
  return gpu != nullptr ? gpu->gpu->state() : ELASTIC_GPU_NOT_AVAILABLE;
}

const char* elastic_gpu_health_detail(const elastic_gpu_health* gpu) {
  if (gpu == nullptr) return "";
  auto* mut = const_cast<elastic_gpu_health*>(gpu);
  mut->detail = gpu->gpu->detail();
  return mut->detail.c_str();
}

uint32_t elastic_gpu_health_device_count(const elastic_gpu_health* gpu) {
  return gpu != nullptr ? gpu->gpu->device_count() : 0;
}

int elastic_gpu_health_check(elastic_gpu_health* gpu, uint32_t device, int timeout_ms,
                             elastic_gpu_report* out) {
  ELASTIC_REQUIRE(gpu, "gpu");
  ELASTIC_REQUIRE(out, "out");
  return guard([&] {
    elastic::GpuReport r = gpu->gpu->check(device, timeout_ms);
    out->device = r.device;
    out->state = r.state;
    out->faults = r.faults;
    out->last_xid = r.last_xid;
    out->ecc_uncorrected = r.ecc_uncorrected;
    out->time_ns = r.time_ns;
    elastic::detail::copy_string(out->detail, sizeof(out->detail), r.detail);
  });
}

// ---- barriers -------------------------------------------------------------------------------

int elastic_barrier_create(const char* path, uint32_t parties, elastic_barrier** out) {
  ELASTIC_REQUIRE(path, "path");
  ELASTIC_REQUIRE(out, "out");
  return guard([&] { *out = new elastic_barrier{elastic::LocalBarrier::create(path, parties)}; });
}

int elastic_barrier_open(const char* path, uint32_t index, elastic_barrier** out) {
  ELASTIC_REQUIRE(path, "path");
  ELASTIC_REQUIRE(out, "out");
  return guard([&] { *out = new elastic_barrier{elastic::LocalBarrier::open(path, index)}; });
}

void elastic_barrier_destroy(elastic_barrier* barrier) { delete barrier; }

int elastic_barrier_wait(elastic_barrier* barrier, int timeout_ms) {
  ELASTIC_REQUIRE(barrier, "barrier");
  return guard([&] { barrier->barrier.wait(timeout_ms); });
}

int elastic_barrier_abort(elastic_barrier* barrier, int32_t participant, const char* reason) {
  ELASTIC_REQUIRE(barrier, "barrier");
  barrier->barrier.abort(participant, reason != nullptr ? reason : "aborted");
  return ELASTIC_OK;
}

int elastic_barrier_reset(elastic_barrier* barrier) {
  ELASTIC_REQUIRE(barrier, "barrier");
  barrier->barrier.reset();
  return ELASTIC_OK;
}

uint64_t elastic_barrier_rounds(const elastic_barrier* barrier) {
  return barrier != nullptr ? barrier->barrier.rounds() : 0;
}

int elastic_tcp_barrier_create(const char* const* peers, uint32_t npeers, uint32_t rank,
                               const char* token, int connect_timeout_ms,
                               elastic_tcp_barrier** out) {
  ELASTIC_REQUIRE(peers, "peers");
  ELASTIC_REQUIRE(out, "out");
  std::vector<std::string> list;
  for (uint32_t i = 0; i < npeers; ++i) {
    if (peers[i] == nullptr) {
      return fail(ELASTIC_ERR_INVALID_ARGUMENT, "peer " + std::to_string(i) + " is NULL");
    }
    list.emplace_back(peers[i]);
  }
  return guard([&] {
    *out = new elastic_tcp_barrier{
        elastic::TcpBarrier(std::move(list), rank, token ? token : "", connect_timeout_ms)};
  });
}

int elastic_tcp_barrier_wait(elastic_tcp_barrier* barrier, int timeout_ms) {
  ELASTIC_REQUIRE(barrier, "barrier");
  return guard([&] { barrier->barrier.wait(timeout_ms); });
}

void elastic_tcp_barrier_destroy(elastic_tcp_barrier* barrier) { delete barrier; }

// ---- watchdog -------------------------------------------------------------------------------

void elastic_watchdog_options_init(elastic_watchdog_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof(*options));
  elastic::WatchdogOptions d;
  options->struct_size = sizeof(*options);
  options->default_hang_timeout_ms = d.default_hang_timeout_ms;
  options->hang_check_interval_ms = d.hang_check_interval_ms;
  options->death_detection = d.death_detection;
  options->poll_interval_ms = d.poll_interval_ms;
  options->reap = d.reap ? 1 : 0;
  options->gpu_check_interval_ms = d.gpu_check_interval_ms;
  options->gpu_check_timeout_ms = d.gpu_check_timeout_ms;
  options->queue_capacity = d.queue_capacity;
}

int elastic_watchdog_create(const elastic_watchdog_options* options, elastic_watchdog** out) {
  ELASTIC_REQUIRE(out, "out");
  return guard([&] { *out = new elastic_watchdog{elastic::Watchdog(from_c(options))}; });
}

void elastic_watchdog_destroy(elastic_watchdog* watchdog) { delete watchdog; }

int elastic_watchdog_set_callback(elastic_watchdog* watchdog, elastic_event_callback callback,
                                  void* user_data) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  return guard([&] {
    if (callback == nullptr) {
      watchdog->watchdog.set_callback({});
      return;
    }
    watchdog->watchdog.set_callback([callback, user_data](const elastic::Event& ev) {
      elastic_event c{};
      to_c(ev, &c);
      callback(&c, user_data);
    });
  });
}

int elastic_watchdog_watch(elastic_watchdog* watchdog, int32_t worker, int32_t pid,
                           const elastic_heartbeat_table* table, int32_t slot,
                           uint64_t hang_timeout_ms, int32_t gpu) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  return guard([&] {
    watchdog->watchdog.watch(worker, pid, table != nullptr ? &table->table : nullptr, slot,
                             hang_timeout_ms, gpu);
  });
}

int elastic_watchdog_set_hang_timeout(elastic_watchdog* watchdog, int32_t worker,
                                      uint64_t hang_timeout_ms) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  if (!watchdog->watchdog.set_hang_timeout(worker, hang_timeout_ms)) {
    return fail(ELASTIC_ERR_NOT_FOUND, "worker " + std::to_string(worker) + " is not watched");
  }
  return ELASTIC_OK;
}

int elastic_watchdog_unwatch(elastic_watchdog* watchdog, int32_t worker) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  if (!watchdog->watchdog.unwatch(worker)) {
    return fail(ELASTIC_ERR_NOT_FOUND, "worker " + std::to_string(worker) +
                                           " is not watched (never watched, unwatched, or "
                                           "already reported as exited)");
  }
  return ELASTIC_OK;
}

int elastic_watchdog_set_gpu_health(elastic_watchdog* watchdog, elastic_gpu_health* gpu) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  return guard([&] { watchdog->watchdog.set_gpu_health(gpu != nullptr ? gpu->gpu : nullptr); });
}

int elastic_watchdog_attach_barrier(elastic_watchdog* watchdog, elastic_barrier* barrier) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  ELASTIC_REQUIRE(barrier, "barrier");
  return guard([&] { watchdog->watchdog.attach_barrier(&barrier->barrier); });
}

int elastic_watchdog_start(elastic_watchdog* watchdog) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  return guard([&] { watchdog->watchdog.start(); });
}

int elastic_watchdog_stop(elastic_watchdog* watchdog) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  return guard([&] { watchdog->watchdog.stop(); });
}

int elastic_watchdog_next_event(elastic_watchdog* watchdog, elastic_event* out, int timeout_ms) {
  ELASTIC_REQUIRE(watchdog, "watchdog");
  ELASTIC_REQUIRE(out, "out");
  int status = ELASTIC_OK;
  int rc = guard([&] {
    auto ev = watchdog->watchdog.next_event(timeout_ms);
    if (ev) {
      to_c(*ev, out);
    } else if (!watchdog->watchdog.running()) {
      status = fail(ELASTIC_ERR_STATE, "the watchdog is not running and has no queued event");
    } else {
      status = fail(ELASTIC_ERR_TIMEOUT, "no event within " + std::to_string(timeout_ms) + " ms");
    }
  });
  return rc != ELASTIC_OK ? rc : status;
}

int elastic_die_with_parent(int sig, int32_t expected_parent) {
  return guard([&] { elastic::die_with_parent(sig, expected_parent); });
}

uint64_t elastic_watchdog_dropped_events(const elastic_watchdog* watchdog) {
  return watchdog != nullptr ? watchdog->watchdog.dropped_events() : 0;
}

int elastic_watchdog_death_detection(const elastic_watchdog* watchdog) {
  return watchdog != nullptr ? watchdog->watchdog.death_detection() : ELASTIC_DEATH_AUTO;
}

}  // extern "C"
