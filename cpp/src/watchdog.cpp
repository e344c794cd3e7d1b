#include "elastic/watchdog.hpp"

#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "elastic/barrier.hpp"
#include "elastic/gpu_health.hpp"
#include "elastic/heartbeat.hpp"
#include "process.hpp"
#include "util.hpp"

namespace elastic {
namespace {

constexpr uint64_t kMaxHangCheckMs = 100;

struct Worker {
  int32_t id = -1;
  pid_t pid = 0;
  int pidfd = -1;
  bool child = false;
  const HeartbeatTable* table = nullptr;
  int32_t slot = -1;
  uint64_t hang_timeout_ms = 0;
  int32_t gpu = -1;
  uint64_t reported_beat = 0;  // last_beat_ns of the hang already reported
};

std::string who(const Worker& w) {
  return "worker " + std::to_string(w.id) + " (pid " + std::to_string(w.pid) + ")";
}

}  // namespace

struct Watchdog::Impl {
  WatchdogOptions opt;
  elastic_death_detection mode = ELASTIC_DEATH_PIDFD;

  mutable std::mutex m;  // workers, barriers, gpu
  std::map<int32_t, Worker> workers;
  std::vector<LocalBarrier*> barriers;
  std::shared_ptr<GpuHealth> gpu;

  std::mutex cb_m;
  Callback callback;

  mutable std::mutex q_m;
  std::condition_variable q_cv;
  std::deque<Event> queue;
  uint64_t dropped = 0;

  std::mutex run_m;  // start/stop
  std::atomic<bool> running{false};
  std::atomic<bool> stopping{false};
  int epfd = -1;
  int wakefd = -1;
  std::thread thread;
  std::thread gpu_thread;
  std::mutex gpu_m;
  std::condition_variable gpu_cv;

  void wake() const {
    uint64_t one = 1;
    ssize_t rc = ::write(wakefd, &one, sizeof(one));
    (void)rc;
  }

  // The callback sees an event before it is queued, so whoever dequeues it knows the callback
  // has run.
  void emit(Event ev) {
    {
      std::lock_guard<std::mutex> g(cb_m);
      if (callback) {
        try {
          callback(ev);
        } catch (...) {
          // A throwing callback must not end the watchdog; the event is still queued.
        }
      }
    }
    {
      std::lock_guard<std::mutex> g(q_m);
      if (opt.queue_capacity > 0) {
        if (queue.size() >= opt.queue_capacity) {
          queue.pop_front();
          ++dropped;
        }
        queue.push_back(std::move(ev));
      }
    }
    q_cv.notify_all();
  }

  void abort_barriers(int32_t worker, const std::string& reason) {
    std::vector<LocalBarrier*> copy;
    {
      std::lock_guard<std::mutex> g(m);
      copy = barriers;
    }
    for (LocalBarrier* b : copy) b->abort(worker, reason);
  }

  void remove_locked(Worker& w) {
    if (w.pidfd >= 0) {
      epoll_ctl(epfd, EPOLL_CTL_DEL, w.pidfd, nullptr);
      ::close(w.pidfd);
      w.pidfd = -1;
    }
  }

  // The worker whose pidfd is `fd` (or, in poll mode, `id`) has ended: report it once.
  void on_exit(int32_t id) {
    Event ev;
    {
      std::lock_guard<std::mutex> g(m);
      auto it = workers.find(id);
      if (it == workers.end()) return;
      Worker& w = it->second;
      detail::ExitStatus st = detail::probe_exit(w.pid, w.pidfd, w.child, opt.reap);
      // A pidfd can turn readable a moment before a child's status is collectable.
      for (int i = 0; i < 20 && w.child && !st.exited; ++i) {
        std::this_thread::sleep_for(std::chrono::microseconds(250));
        st = detail::probe_exit(w.pid, w.pidfd, w.child, opt.reap);
      }
      if (!st.exited) return;  // spurious: keep watching
      ev.worker = w.id;
      ev.kind = ELASTIC_EVENT_EXITED;
      ev.time_ns = now_ns();
      ev.pid = w.pid;
      ev.exit_code = st.exit_code;
      ev.signal = st.signal;
      ev.gpu = w.gpu;
      ev.detail = who(w) + " " + detail::describe_exit(st);
      remove_locked(w);
      workers.erase(it);
    }
    abort_barriers(ev.worker, ev.detail);
    emit(std::move(ev));
  }

  static Event hung(const Worker& w, uint64_t now, uint64_t step, std::string detail) {
    Event ev;
    ev.worker = w.id;
    ev.kind = ELASTIC_EVENT_HUNG;
    ev.time_ns = now;
    ev.pid = w.pid;
    ev.gpu = w.gpu;
    ev.step = step;
    ev.detail = std::move(detail);
    return ev;
  }

  // Returns the interval until the next hang check, in ms (UINT64_MAX: no worker to check).
  uint64_t check_hangs() {
    std::vector<Event> found;
    uint64_t interval = UINT64_MAX;
    {
      std::lock_guard<std::mutex> g(m);
      const uint64_t now = now_ns();
      for (auto& [id, w] : workers) {
        if (w.table == nullptr || w.slot < 0) continue;
        SlotInfo info{};
        try {
          info = w.table->read(static_cast<uint32_t>(w.slot));
        } catch (const std::exception& e) {
          // The file is the workers' to break (truncate, overwrite, replace): this worker's
          // failure, reported once, never an exception or a signal that ends the supervisor.
          if (w.reported_beat == UINT64_MAX) continue;
          w.reported_beat = UINT64_MAX;
          Event ev = hung(w, now, 0, who(w) + ": its heartbeat cannot be trusted: " + e.what());
          ev.kind = ELASTIC_EVENT_BAD_HEARTBEAT;
          found.push_back(std::move(ev));
          continue;
        }
        uint64_t timeout = info.timeout_ms != 0       ? info.timeout_ms
                           : w.hang_timeout_ms != 0   ? w.hang_timeout_ms
                                                      : opt.default_hang_timeout_ms;
        interval = std::min(interval, timeout != 0 ? std::max<uint64_t>(1, timeout / 10)
                                                   : kMaxHangCheckMs);
        if (timeout == 0 || info.last_beat_ns == 0 || info.state != ELASTIC_SLOT_BEATING) continue;
        if (info.last_beat_ns == w.reported_beat || now <= info.last_beat_ns) continue;
        uint64_t silent_ms = (now - info.last_beat_ns) / 1000000;
        if (silent_ms <= timeout) continue;
        w.reported_beat = info.last_beat_ns;
        found.push_back(hung(w, now, info.step,
                             who(w) + " has not beaten for " + std::to_string(silent_ms) +
                                 " ms (timeout " + std::to_string(timeout) + " ms); last step " +
                                 std::to_string(info.step)));
      }
    }
    for (auto& ev : found) {
      abort_barriers(ev.worker, ev.detail);
      emit(std::move(ev));
    }
    if (opt.hang_check_interval_ms != 0 && interval != UINT64_MAX) {
      interval = opt.hang_check_interval_ms;
    }
    return interval == UINT64_MAX ? interval : std::min(interval, kMaxHangCheckMs);
  }

  void poll_deaths() {
    std::vector<int32_t> ended;
    {
      std::lock_guard<std::mutex> g(m);
      for (auto& [id, w] : workers) {
        // WNOWAIT here: on_exit() reads (and, if asked, reaps) the status.
        if (detail::probe_exit(w.pid, -1, w.child, false).exited) ended.push_back(id);
      }
    }
    for (int32_t id : ended) on_exit(id);
  }

  void loop() {
    epoll_event evs[32];
    uint64_t next_hang_check = 0;
    uint64_t next_poll = 0;
    while (!stopping.load(std::memory_order_acquire)) {
      uint64_t now = now_ns();
      uint64_t wake_at = UINT64_MAX;
      if (next_hang_check != UINT64_MAX) wake_at = std::min(wake_at, next_hang_check);
      if (mode == ELASTIC_DEATH_POLL) wake_at = std::min(wake_at, next_poll);
      int timeout = -1;
      if (wake_at != UINT64_MAX) {
        timeout = wake_at <= now ? 0 : static_cast<int>((wake_at - now + 999999) / 1000000);
      }
      int n = epoll_wait(epfd, evs, 32, timeout);
      if (n < 0 && errno != EINTR) break;
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.u64 == UINT64_MAX) {
          uint64_t v;
          ssize_t rc = ::read(wakefd, &v, sizeof(v));
          (void)rc;
          next_hang_check = 0;  // a watch was added or removed: re-plan
          continue;
        }
        on_exit(static_cast<int32_t>(evs[i].data.u64));
      }
      now = now_ns();
      try {
        if (mode == ELASTIC_DEATH_POLL && now >= next_poll) {
          poll_deaths();
          next_poll = now + static_cast<uint64_t>(std::max<uint32_t>(1, opt.poll_interval_ms)) *
                                1000000ull;
        }
        if (next_hang_check != UINT64_MAX && now >= next_hang_check) {
          uint64_t interval = check_hangs();
          next_hang_check = interval == UINT64_MAX ? UINT64_MAX : now + interval * 1000000ull;
        }
      } catch (const std::exception&) {
        // An exception escaping this thread would std::terminate the supervisor: skip this
        // check (out of memory is the only cause left) and try again shortly.
        next_hang_check = now + kMaxHangCheckMs * 1000000ull;
      }
    }
  }

  void gpu_loop() {
    std::map<int32_t, uint32_t> previous;
    std::unique_lock<std::mutex> lk(gpu_m);
    while (!stopping.load(std::memory_order_acquire)) {
      std::shared_ptr<GpuHealth> g;
      {
        std::lock_guard<std::mutex> wg(m);
        g = gpu;
      }
      if (g) {
        lk.unlock();
        std::vector<GpuReport> reports;
        try {
          reports = g->check_all(opt.gpu_check_timeout_ms);
        } catch (const std::exception&) {
          // As in loop(): never let an exception end the supervisor; check again next time.
        }
        lk.lock();
        for (const GpuReport& r : reports) {
          if (r.state != ELASTIC_GPU_HEALTHY && r.state != ELASTIC_GPU_UNHEALTHY) continue;
          uint32_t fresh = r.faults & ~previous[r.device];
          previous[r.device] = r.faults;
          if (fresh == 0) continue;
          std::vector<Event> events;
          {
            std::lock_guard<std::mutex> wg(m);
            for (auto& [id, w] : workers) {
              if (w.gpu != r.device) continue;
              Event ev;
              ev.worker = id;
              ev.pid = w.pid;
              events.push_back(ev);
            }
          }
          if (events.empty()) events.emplace_back();
          for (Event& ev : events) {
            ev.kind = ELASTIC_EVENT_GPU_UNHEALTHY;
            ev.time_ns = r.time_ns;
            ev.gpu = r.device;
            ev.detail = r.detail + " [" + gpu_fault_names(fresh) + "]";
            if (ev.worker >= 0) abort_barriers(ev.worker, ev.detail);
            emit(ev);
          }
        }
      }
      gpu_cv.wait_for(lk, std::chrono::milliseconds(opt.gpu_check_interval_ms),
                      [&] { return stopping.load(std::memory_order_acquire); });
    }
  }
};

Watchdog::Watchdog(const WatchdogOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->opt = options;
  if (options.death_detection == ELASTIC_DEATH_POLL) {
    impl_->mode = ELASTIC_DEATH_POLL;
  } else if (detail::pidfds_supported()) {
    impl_->mode = ELASTIC_DEATH_PIDFD;
  } else if (options.death_detection == ELASTIC_DEATH_PIDFD) {
    throw Error(ELASTIC_ERR_NOT_AVAILABLE,
                "pidfd death detection was asked for, but this kernel has no pidfd_open (Linux "
                "5.3 or newer needed): use ELASTIC_DEATH_AUTO or ELASTIC_DEATH_POLL");
  } else {
    impl_->mode = ELASTIC_DEATH_POLL;
  }
  if (options.death_detection < ELASTIC_DEATH_AUTO ||
      options.death_detection > ELASTIC_DEATH_POLL) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "death_detection " + std::to_string(options.death_detection) +
                    " is not one of AUTO (0), PIDFD (1), POLL (2)");
  }
  impl_->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (impl_->epfd < 0) throw detail::system_error(errno, "watchdog: epoll_create1");
  impl_->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl_->wakefd < 0) {
    int err = errno;
    ::close(impl_->epfd);
    throw detail::system_error(err, "watchdog: eventfd");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = UINT64_MAX;
  epoll_ctl(impl_->epfd, EPOLL_CTL_ADD, impl_->wakefd, &ev);
}

Watchdog::~Watchdog() {
  stop();
  std::lock_guard<std::mutex> g(impl_->m);
  for (auto& [id, w] : impl_->workers) impl_->remove_locked(w);
  impl_->workers.clear();
  ::close(impl_->wakefd);
  ::close(impl_->epfd);
}

void Watchdog::set_callback(Callback callback) {
  std::lock_guard<std::mutex> g(impl_->cb_m);
  impl_->callback = std::move(callback);
}

void Watchdog::watch(int32_t worker, pid_t pid, const HeartbeatTable* table, int32_t slot,
                     uint64_t hang_timeout_ms, int32_t gpu) {
  if (worker < 0) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "worker id " + std::to_string(worker) + " is negative: use 0 or more");
  }
  if (pid <= 0) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "pid " + std::to_string(pid) + " is not a process id: give a positive pid");
  }
  if (slot >= 0 && table == nullptr) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT, "slot " + std::to_string(slot) +
                                                  " given without a heartbeat table: pass the "
                                                  "table, or slot -1 to skip hang checks");
  }
  if (table != nullptr && slot >= 0 && static_cast<uint32_t>(slot) >= table->capacity()) {
    throw Error(ELASTIC_ERR_INVALID_ARGUMENT,
                "slot " + std::to_string(slot) + " is out of range: heartbeat table '" +
                    table->path() + "' has " + std::to_string(table->capacity()) + " slots");
  }
  Worker w;
  w.id = worker;
  w.pid = pid;
  w.child = detail::is_child(pid);
  w.table = slot >= 0 ? table : nullptr;
  w.slot = slot;
  w.hang_timeout_ms = hang_timeout_ms;
  w.gpu = gpu;
  std::lock_guard<std::mutex> g(impl_->m);
  if (impl_->workers.count(worker) != 0) {
    throw Error(ELASTIC_ERR_STATE, "worker " + std::to_string(worker) +
                                       " is already watched: unwatch it first or use another id");
  }
  if (impl_->mode == ELASTIC_DEATH_PIDFD) {
    w.pidfd = detail::pidfd_open(pid);
    if (w.pidfd < 0) {
      int err = errno;
      if (err == ESRCH) {
        throw Error(ELASTIC_ERR_NOT_FOUND, "no process with pid " + std::to_string(pid) +
                                               " to watch as worker " + std::to_string(worker) +
                                               " (it has already ended and been reaped)");
      }
      throw detail::system_error(err, "pidfd_open(" + std::to_string(pid) + ")");
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = static_cast<uint64_t>(worker);
    if (epoll_ctl(impl_->epfd, EPOLL_CTL_ADD, w.pidfd, &ev) != 0) {
      int err = errno;
      ::close(w.pidfd);
      throw detail::system_error(err, "watchdog: epoll_ctl");
    }
  } else if (!w.child && ::kill(pid, 0) != 0 && errno == ESRCH) {
    throw Error(ELASTIC_ERR_NOT_FOUND, "no process with pid " + std::to_string(pid) +
                                           " to watch as worker " + std::to_string(worker));
  }
  impl_->workers.emplace(worker, w);
  impl_->wake();
}

bool Watchdog::set_hang_timeout(int32_t worker, uint64_t hang_timeout_ms) {
  std::lock_guard<std::mutex> g(impl_->m);
  auto it = impl_->workers.find(worker);
  if (it == impl_->workers.end()) return false;
  it->second.hang_timeout_ms = hang_timeout_ms;
  impl_->wake();  // the check interval may change
  return true;
}

bool Watchdog::unwatch(int32_t worker) {
  std::lock_guard<std::mutex> g(impl_->m);
  auto it = impl_->workers.find(worker);
  if (it == impl_->workers.end()) return false;
  impl_->remove_locked(it->second);
  impl_->workers.erase(it);
  impl_->wake();
  return true;
}

size_t Watchdog::watched() const {
  std::lock_guard<std::mutex> g(impl_->m);
  return impl_->workers.size();
}

void Watchdog::set_gpu_health(std::shared_ptr<GpuHealth> gpu) {
  std::lock_guard<std::mutex> g(impl_->m);
  impl_->gpu = std::move(gpu);
}

void Watchdog::attach_barrier(LocalBarrier* barrier) {
  if (barrier == nullptr) throw Error(ELASTIC_ERR_INVALID_ARGUMENT, "barrier is NULL");
  std::lock_guard<std::mutex> g(impl_->m);
  impl_->barriers.push_back(barrier);
}

void Watchdog::start() {
  std::lock_guard<std::mutex> g(impl_->run_m);
  if (impl_->running.load()) {
    throw Error(ELASTIC_ERR_STATE, "the watchdog is already running");
  }
  impl_->stopping.store(false);
  impl_->thread = std::thread([this] { impl_->loop(); });
  if (impl_->opt.gpu_check_interval_ms > 0) {
    impl_->gpu_thread = std::thread([this] { impl_->gpu_loop(); });
  }
  impl_->running.store(true);
}

void Watchdog::stop() {
  std::lock_guard<std::mutex> g(impl_->run_m);
  if (!impl_->running.load()) return;
  impl_->stopping.store(true, std::memory_order_release);
  impl_->wake();
  {
    std::lock_guard<std::mutex> lk(impl_->gpu_m);
    impl_->gpu_cv.notify_all();
  }
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->gpu_thread.joinable()) impl_->gpu_thread.join();
  {
    std::lock_guard<std::mutex> lk(impl_->q_m);
    impl_->running.store(false);
  }
  impl_->q_cv.notify_all();
}

bool Watchdog::running() const { return impl_->running.load(); }

std::optional<Event> Watchdog::next_event(int timeout_ms) {
  std::unique_lock<std::mutex> lk(impl_->q_m);
  auto ready = [&] { return !impl_->queue.empty() || !impl_->running.load(); };
  if (timeout_ms < 0) {
    impl_->q_cv.wait(lk, ready);
  } else {
    impl_->q_cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
  }
  if (impl_->queue.empty()) return std::nullopt;
  Event ev = std::move(impl_->queue.front());
  impl_->queue.pop_front();
  return ev;
}

uint64_t Watchdog::dropped_events() const {
  std::lock_guard<std::mutex> g(impl_->q_m);
  return impl_->dropped;
}

elastic_death_detection Watchdog::death_detection() const { return impl_->mode; }

}  // namespace elastic
