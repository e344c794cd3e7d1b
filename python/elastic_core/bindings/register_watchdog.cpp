// Watchdog and Event. The callback runs on the watchdog's thread and takes the GIL there; every
// call that may wait for that thread releases the GIL first, so the two never deadlock.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <map>
#include <set>
#include <vector>

#include "common.hpp"
#include "elastic/watchdog.hpp"

namespace elastic_py {
namespace {

constexpr int kPollSliceMs = 100;  // how often a blocked poll() checks for Ctrl-C

struct PyWatchdog;
// Started watchdogs, stopped at interpreter exit: a watchdog thread must not call into Python
// while the interpreter finalizes. Guarded by the GIL.
std::set<PyWatchdog*>& live() {
  static std::set<PyWatchdog*> set;
  return set;
}

struct PyWatchdog {
  PyWatchdog() = default;
  PyWatchdog(PyWatchdog&&) = default;
  PyWatchdog& operator=(PyWatchdog&&) = default;
  ~PyWatchdog() { close(); }

  std::unique_ptr<elastic::Watchdog> wd;
  // What the C++ watchdog points to, kept alive while it may use them.
  std::map<int32_t, std::shared_ptr<elastic::HeartbeatTable>> tables;
  std::vector<std::shared_ptr<elastic::LocalBarrier>> barriers;
  std::shared_ptr<elastic::GpuHealth> gpu;

  elastic::Watchdog& get() const {
    if (!wd) throw py::value_error("the watchdog is closed");
    return *wd;
  }

  void set_callback(const py::object& callback) {
    elastic::Watchdog::Callback cb;
    if (!callback.is_none()) {
      if (!PyCallable_Check(callback.ptr())) {
        throw py::type_error("callback must be callable, got " +
                             py::repr(callback).cast<std::string>());
      }
      // The last reference may be dropped on the watchdog's thread: take the GIL for it.
      std::shared_ptr<py::object> fn(new py::object(callback), [](py::object* o) {
        py::gil_scoped_acquire gil;
        delete o;
      });
      cb = [fn](const elastic::Event& ev) {
        py::gil_scoped_acquire gil;
        try {
          (*fn)(ev);
        } catch (py::error_already_set& e) {
          e.discard_as_unraisable("elastic_core.Watchdog callback");
        }
      };
    }
    elastic::Watchdog& w = get();
    py::gil_scoped_release nogil;
    w.set_callback(std::move(cb));
  }

  std::optional<elastic::Event> poll(std::optional<double> timeout) {
    elastic::Watchdog& w = get();
    int total = timeout_ms(timeout, "timeout");
    uint64_t deadline = total < 0 ? UINT64_MAX : elastic::now_ns() + uint64_t(total) * 1000000ull;
    for (;;) {
      int slice = kPollSliceMs;
      if (deadline != UINT64_MAX) {
        uint64_t now = elastic::now_ns();
        uint64_t left = now >= deadline ? 0 : (deadline - now + 999999) / 1000000;
        slice = static_cast<int>(std::min<uint64_t>(left, kPollSliceMs));
      }
      std::optional<elastic::Event> ev;
      {
        py::gil_scoped_release nogil;
        ev = w.next_event(slice);
      }
      if (ev) return ev;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (!w.running()) return std::nullopt;
      if (deadline != UINT64_MAX && elastic::now_ns() >= deadline) return std::nullopt;
    }
  }

  void start() {
    get().start();
    live().insert(this);
  }

  void close() {
    live().erase(this);
    if (!wd) return;
    {
      py::gil_scoped_release nogil;
      wd->stop();
      wd->set_callback({});
    }
    wd.reset();
    tables.clear();
    barriers.clear();
    gpu.reset();
  }
};

elastic_death_detection parse_mode(const std::string& mode) {
  if (mode == "auto") return ELASTIC_DEATH_AUTO;
  if (mode == "pidfd") return ELASTIC_DEATH_PIDFD;
  if (mode == "poll") return ELASTIC_DEATH_POLL;
  throw py::value_error("death_detection='" + mode +
                        "' is not one of 'auto', 'pidfd', 'poll'");
}

std::string mode_name(elastic_death_detection m) {
  return m == ELASTIC_DEATH_PIDFD ? "pidfd" : m == ELASTIC_DEATH_POLL ? "poll" : "auto";
}

using WatchdogClass = py::class_<PyWatchdog>;

void register_event(py::module_& m) {
  py::native_enum<elastic_event_kind>(m, "EventKind", "enum.IntEnum", "What the watchdog saw.")
      .value("EXITED", ELASTIC_EVENT_EXITED)
      .value("HUNG", ELASTIC_EVENT_HUNG)
      .value("GPU_UNHEALTHY", ELASTIC_EVENT_GPU_UNHEALTHY)
      .value("BAD_HEARTBEAT", ELASTIC_EVENT_BAD_HEARTBEAT)
      .finalize();

  py::class_<elastic::Event>(m, "Event", "One finding of the watchdog.")
      .def_readonly("worker", &elastic::Event::worker, "worker id, -1 if none applies")
      .def_readonly("kind", &elastic::Event::kind)
      .def_readonly("time_ns", &elastic::Event::time_ns, "when it was seen (CLOCK_MONOTONIC)")
      .def_readonly("pid", &elastic::Event::pid)
      .def_property_readonly(
          "exit_code",
          [](const elastic::Event& e) -> std::optional<int> {
            if (e.kind != ELASTIC_EVENT_EXITED || e.exit_code < 0) return std::nullopt;
            return e.exit_code;
          },
          "exit status if the process exited normally and it could be read, else None")
      .def_property_readonly(
          "signal",
          [](const elastic::Event& e) -> std::optional<int> {
            if (e.signal == 0) return std::nullopt;
            return e.signal;
          },
          "the signal that ended the process, else None")
      .def_property_readonly("gpu",
                             [](const elastic::Event& e) -> std::optional<int> {
                               if (e.gpu < 0) return std::nullopt;
                               return e.gpu;
                             })
      .def_readonly("step", &elastic::Event::step, "HUNG: the last step beaten")
      .def_readonly("detail", &elastic::Event::detail)
      .def("__repr__", [](const elastic::Event& e) {
        return "Event(kind=" + std::string(elastic_event_kind_name(e.kind)) +
               ", worker=" + std::to_string(e.worker) + ", pid=" + std::to_string(e.pid) +
               ", detail=" + py::repr(py::str(e.detail)).cast<std::string>() + ")";
      });
}

PyWatchdog make_watchdog(double default_hang_timeout, double hang_check_interval,
                         const std::string& death_detection, double poll_interval, bool reap,
                         double gpu_check_interval, double gpu_check_timeout,
                         uint32_t queue_capacity, const py::object& gpu,
                         const py::object& callback) {
  elastic::WatchdogOptions o;
  o.default_hang_timeout_ms = duration_ms(default_hang_timeout, "default_hang_timeout");
  o.hang_check_interval_ms =
      static_cast<uint32_t>(duration_ms(hang_check_interval, "hang_check_interval"));
  o.death_detection = parse_mode(death_detection);
  o.poll_interval_ms =
      static_cast<uint32_t>(std::max<uint64_t>(1, duration_ms(poll_interval, "poll_interval")));
  o.reap = reap;
  o.gpu_check_interval_ms =
      static_cast<uint32_t>(duration_ms(gpu_check_interval, "gpu_check_interval"));
  o.gpu_check_timeout_ms =
      static_cast<int32_t>(duration_ms(gpu_check_timeout, "gpu_check_timeout"));
  o.queue_capacity = queue_capacity;
  PyWatchdog w;
  w.wd = std::make_unique<elastic::Watchdog>(o);
  if (!gpu.is_none()) {
    w.gpu = gpu_of(gpu);
    w.wd->set_gpu_health(w.gpu);
  }
  w.set_callback(callback);
  return w;
}

// What is watched: workers (their pids, heartbeat slots, GPUs) and barriers to abort.
void add_watching(WatchdogClass& cls) {
  cls.def(
         "watch",
         [](PyWatchdog& w, int32_t worker, int32_t pid, const py::object& table,
            std::optional<int32_t> slot, double hang_timeout, std::optional<int32_t> gpu) {
           std::shared_ptr<elastic::HeartbeatTable> t;
           if (!table.is_none()) t = table_of(table);
           if (!table.is_none() && !t) throw py::value_error("the heartbeat table is closed");
           int32_t s = slot.value_or(t ? worker : -1);
           w.get().watch(worker, pid, t.get(), t ? s : -1,
                         duration_ms(hang_timeout, "hang_timeout"), gpu.value_or(-1));
           if (t) w.tables[worker] = t;
         },
         py::arg("worker"), py::arg("pid"), py::arg("table") = py::none(),
         py::arg("slot") = py::none(), py::arg("hang_timeout") = 0.0,
         py::arg("gpu") = py::none(),
         "Watch process `pid` as `worker`. With a heartbeat `table`, hangs are checked on "
         "`slot` (default: the worker id) against the worker's own timeout, else "
         "`hang_timeout` seconds, else the default.")
      .def(
          "set_hang_timeout",
          [](PyWatchdog& w, int32_t worker, double seconds) {
            return w.get().set_hang_timeout(worker, duration_ms(seconds, "seconds"));
          },
          py::arg("worker"), py::arg("seconds"),
          "Change a watched worker's hang timeout; False if it is not watched.")
      .def(
          "unwatch",
          [](PyWatchdog& w, int32_t worker) {
            bool found = w.get().unwatch(worker);
            w.tables.erase(worker);
            return found;
          },
          py::arg("worker"))
      .def_property_readonly("watched", [](const PyWatchdog& w) { return w.get().watched(); })
      .def(
          "attach_barrier",
          [](PyWatchdog& w, const py::object& barrier) {
            auto b = barrier_of(barrier);
            if (!b) throw py::value_error("the barrier is closed");
            w.get().attach_barrier(b.get());
            w.barriers.push_back(b);
          },
          py::arg("barrier"), "Abort `barrier`, naming the worker, when a worker exits or hangs.");
}

// Its life: the callback, start, stop, close, and what it reports about itself.
void add_life(WatchdogClass& cls) {
  cls.def("set_callback", &PyWatchdog::set_callback, py::arg("callback"))
      .def("start", &PyWatchdog::start)
      .def("stop",
           [](PyWatchdog& w) {
             elastic::Watchdog& wd = w.get();
             py::gil_scoped_release nogil;
             wd.stop();
           })
      .def("close", &PyWatchdog::close, "Stop, drop the callback and release every handle.")
      .def_property_readonly("running", [](const PyWatchdog& w) { return w.wd && w.wd->running(); })
      .def_property_readonly("death_detection",
                             [](const PyWatchdog& w) { return mode_name(w.get().death_detection()); })
      .def_property_readonly("dropped_events",
                             [](const PyWatchdog& w) { return w.get().dropped_events(); })
      .def("__enter__",
           [](py::object self) {
             self.cast<PyWatchdog&>().start();
             return self;
           })
      .def("__exit__", [](PyWatchdog& w, const py::args&) { w.close(); });
}

// Its events, read from the queue.
void add_reading(WatchdogClass& cls) {
  cls.def("poll", &PyWatchdog::poll, py::arg("timeout") = py::none(),
          "The oldest event, waiting at most `timeout` seconds (None: until one comes or the "
          "watchdog stops); None if none came.")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", [](PyWatchdog& w) {
        auto ev = w.poll(std::nullopt);
        if (!ev) throw py::stop_iteration();
        return *ev;
      });
}

}  // namespace

void register_watchdog(py::module_& m) {
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    std::set<PyWatchdog*> all = live();
    for (PyWatchdog* w : all) w->close();
  }));

  m.def(
      "die_with_parent",
      [](int sig, int32_t expected_parent) { elastic::die_with_parent(sig, expected_parent); },
      py::arg("signal") = 9, py::arg("expected_parent") = 0,
      "Receive `signal` when the parent process exits (Linux PR_SET_PDEATHSIG), so this "
      "process never outlives a killed supervisor. Raises NotFoundError if `expected_parent` "
      "(> 0) is no longer the parent: it has died already.");
  register_event(m);

  WatchdogClass cls(m, "Watchdog",
                    "Watches worker processes from its own thread: deaths through pidfds, "
                    "hangs through stale heartbeats, GPU faults through NVML. Events reach "
                    "the callback (on the watchdog's thread) and a queue read by poll() or "
                    "by iterating.");
  cls.def(py::init(&make_watchdog), py::kw_only(), py::arg("default_hang_timeout") = 0.0,
          py::arg("hang_check_interval") = 0.0, py::arg("death_detection") = "auto",
          py::arg("poll_interval") = 0.005, py::arg("reap") = false,
          py::arg("gpu_check_interval") = 0.0, py::arg("gpu_check_timeout") = 2.0,
          py::arg("queue_capacity") = 1024, py::arg("gpu") = py::none(),
          py::arg("callback") = py::none());
  add_watching(cls);
  add_life(cls);
  add_reading(cls);
}

}  // namespace elastic_py
