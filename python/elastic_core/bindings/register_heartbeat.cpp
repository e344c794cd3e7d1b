// HeartbeatTable, Heartbeat, and the module-level beat() that workers call on every step.
#include <pthread.h>
#include <pybind11/stl.h>

#include <memory>

#include "common.hpp"
#include "elastic/heartbeat.hpp"

namespace elastic_py {
namespace {

// ---- the process-wide heartbeat behind elastic_core.beat() ------------------------------------
// Resolved from the environment on the first call; after fork() the child starts unresolved (it
// must not beat its parent's slot). Accessed with the GIL held.
enum class Resolved { kNotYet, kActive, kAbsent };
Resolved g_resolved = Resolved::kNotYet;
elastic::Heartbeat* g_heartbeat = nullptr;

void after_fork_in_child() {
  g_heartbeat = nullptr;  // deliberately leaked: detaching would mark the parent's slot
  g_resolved = Resolved::kNotYet;
}

bool resolve() {
  if (g_resolved == Resolved::kNotYet) {
    try {
      auto hb = elastic::Heartbeat::from_env();
      if (hb) {
        g_heartbeat = new elastic::Heartbeat(std::move(*hb));
        g_resolved = Resolved::kActive;
      } else {
        g_resolved = Resolved::kAbsent;
      }
    } catch (const elastic::Error& e) {
      set_python_error(e);
      return false;
    }
  }
  return true;
}

// beat(step=None): METH_FASTCALL, without pybind11's argument machinery, since it runs on every
// training step.
PyObject* py_beat(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* step = nargs > 0 ? args[0] : nullptr;
  Py_ssize_t nkw = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs + nkw > 1 ||
      (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "step") != 0)) {
    PyErr_SetString(PyExc_TypeError, "beat() takes one optional argument, step");
    return nullptr;
  }
  if (nkw == 1) step = args[nargs];
  if (g_resolved != Resolved::kActive) {
    if (!resolve()) return nullptr;
    if (g_resolved != Resolved::kActive) Py_RETURN_NONE;
  }
  if (step == nullptr || step == Py_None) {
    g_heartbeat->beat();
  } else {
    unsigned long long value = PyLong_AsUnsignedLongLong(step);
    if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      PyObject* r = PyObject_Repr(step);
      PyErr_Format(PyExc_ValueError, "beat(step=%s): step must be an int from 0 to 2**64-1",
                   r != nullptr ? PyUnicode_AsUTF8(r) : "?");
      Py_XDECREF(r);
      return nullptr;
    }
    g_heartbeat->beat(value);
  }
  Py_RETURN_NONE;
}

PyMethodDef beat_def = {
    "beat", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_beat)),
    METH_FASTCALL | METH_KEYWORDS,
    "beat(step=None)\n--\n\n"
    "Record that this worker is making progress: advance the step counter (or set it to `step`)\n"
    "and the time of the last beat. Finds its slot from ELASTIC_HEARTBEAT_FILE and\n"
    "ELASTIC_HEARTBEAT_SLOT (set by elasticrun); a no-op when they are unset."};

// Holds a table for Python; shared so that a watchdog watching it keeps it alive.
struct PyTable {
  std::shared_ptr<elastic::HeartbeatTable> table;
  elastic::HeartbeatTable& get() const {
    if (!table) throw py::value_error("the heartbeat table is closed");
    return *table;
  }
};

struct PyHeartbeat {
  std::unique_ptr<elastic::Heartbeat> hb;
  elastic::Heartbeat& get() const {
    if (!hb) throw py::value_error("the heartbeat is detached");
    return *hb;
  }
};

// A worker's own hang timeout in ms: at most ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS, which the
// watchdog takes for a broken slot when it reads more.
uint64_t own_timeout_ms(double seconds, const char* name) {
  const uint64_t ms = duration_ms(seconds, name);
  if (ms > ELASTIC_HEARTBEAT_MAX_TIMEOUT_MS) {
    throw py::value_error(std::string(name) + "=" + py::repr(py::float_(seconds)).cast<std::string>() +
                          " is longer than the 604800 s (7 days) a worker may ask for: give "
                          "less, or use elastic_core.quiet() for a phase without a limit");
  }
  return ms;
}

}  // namespace

std::shared_ptr<elastic::HeartbeatTable> table_of(const py::object& obj) {
  return obj.cast<const PyTable&>().table;
}

namespace {

// A slot as the supervisor reads it.
void register_slot(py::module_& m) {
  py::native_enum<elastic_slot_state>(m, "SlotState", "enum.IntEnum",
                                      "State of a heartbeat slot.")
      .value("EMPTY", ELASTIC_SLOT_EMPTY)
      .value("ATTACHED", ELASTIC_SLOT_ATTACHED)
      .value("BEATING", ELASTIC_SLOT_BEATING)
      .value("DETACHED", ELASTIC_SLOT_DETACHED)
      .finalize();

  py::class_<elastic_slot_info>(m, "SlotInfo", "A snapshot of one heartbeat slot.")
      .def_readonly("pid", &elastic_slot_info::pid)
      .def_property_readonly("state",
                             [](const elastic_slot_info& s) {
                               return static_cast<elastic_slot_state>(s.state);
                             })
      .def_readonly("step", &elastic_slot_info::step)
      .def_readonly("last_beat_ns", &elastic_slot_info::last_beat_ns)
      .def_readonly("timeout_ms", &elastic_slot_info::timeout_ms)
      .def("__repr__", [](const elastic_slot_info& s) {
        return "SlotInfo(pid=" + std::to_string(s.pid) + ", state=" +
               py::repr(py::cast(static_cast<elastic_slot_state>(s.state))).cast<std::string>() +
               ", step=" + std::to_string(s.step) + ", last_beat_ns=" +
               std::to_string(s.last_beat_ns) + ", timeout_ms=" + std::to_string(s.timeout_ms) +
               ")";
      });
}

// The supervisor's table.
void register_table(py::module_& m) {
  py::class_<PyTable>(m, "HeartbeatTable",
                      "The shared-memory heartbeat table of a supervisor. Make one with create() "
                      "or open(); close() (or leaving a `with` block) unmaps it, and the creator "
                      "removes the file.")
      .def_static(
          "create",
          [](const std::string& path, uint32_t slots) {
            return PyTable{std::make_shared<elastic::HeartbeatTable>(
                elastic::HeartbeatTable::create(path, slots))};
          },
          py::arg("path"), py::arg("slots"))
      .def_static(
          "open",
          [](const std::string& path) {
            return PyTable{
                std::make_shared<elastic::HeartbeatTable>(elastic::HeartbeatTable::open(path))};
          },
          py::arg("path"))
      .def_property_readonly("capacity", [](const PyTable& t) { return t.get().capacity(); })
      .def_property_readonly("generation", [](const PyTable& t) { return t.get().generation(); })
      .def_property_readonly("path", [](const PyTable& t) { return t.get().path(); })
      .def_property_readonly("owner", [](const PyTable& t) { return t.get().owner(); })
      .def_property_readonly("closed", [](const PyTable& t) { return !t.table; })
      .def("read", [](const PyTable& t, uint32_t slot) { return t.get().read(slot); },
           py::arg("slot"))
      .def("reset_slot", [](PyTable& t, uint32_t slot) { t.get().reset_slot(slot); },
           py::arg("slot"))
      .def("reset", [](PyTable& t) { t.get().reset(); })
      .def("close", [](PyTable& t) { t.table.reset(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyTable& t, const py::args&) { t.table.reset(); });
}

// A worker's handle on its slot.
void register_handle(py::module_& m) {
  py::class_<PyHeartbeat>(m, "Heartbeat",
                          "A worker's handle on its slot. Most code calls elastic_core.beat() "
                          "instead.")
      .def_static(
          "attach",
          [](const std::string& path, uint32_t slot) {
            return PyHeartbeat{
                std::make_unique<elastic::Heartbeat>(elastic::Heartbeat::attach(path, slot))};
          },
          py::arg("path"), py::arg("slot"))
      .def(
          "beat",
          [](PyHeartbeat& h, std::optional<uint64_t> step) {
            if (step) {
              h.get().beat(*step);
            } else {
              h.get().beat();
            }
          },
          py::arg("step") = py::none())
      .def(
          "set_timeout",
          [](PyHeartbeat& h, double seconds) {
            h.get().set_timeout_ms(own_timeout_ms(seconds, "timeout"));
          },
          py::arg("seconds"),
          "Ask the watchdog to use this hang timeout (0: the supervisor's).")
      .def_property_readonly("slot", [](const PyHeartbeat& h) { return h.get().slot(); })
      .def_property_readonly("step", [](const PyHeartbeat& h) { return h.get().step(); })
      .def("detach", [](PyHeartbeat& h) { h.hb.reset(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyHeartbeat& h, const py::args&) { h.hb.reset(); });
}

// The module's functions over this worker's own slot, found from the environment.
void register_own_slot(py::module_& m) {
  PyObject* fn = PyCFunction_NewEx(&beat_def, nullptr, m.attr("__name__").ptr());
  if (fn == nullptr) throw py::error_already_set();
  m.add_object("beat", py::reinterpret_steal<py::object>(fn));

  m.def(
      "set_hang_timeout",
      [](double seconds) {
        if (!resolve()) throw py::error_already_set();
        if (g_heartbeat != nullptr) {
          g_heartbeat->set_timeout_ms(own_timeout_ms(seconds, "seconds"));
        }
      },
      py::arg("seconds"),
      "Set this worker's own hang timeout (for example around a long checkpoint); 0 returns to "
      "the launcher's. A no-op outside elasticrun.");
  m.def(
      "current_step",
      []() -> uint64_t {
        if (!resolve()) throw py::error_already_set();
        return g_heartbeat != nullptr ? g_heartbeat->step() : 0;
      },
      "The step this worker last beat with (0 before its first beat and outside elasticrun).");
  m.def(
      "hang_timeout",
      []() -> double {
        if (!resolve()) throw py::error_already_set();
        return g_heartbeat != nullptr ? static_cast<double>(g_heartbeat->timeout_ms()) / 1000.0
                                      : 0.0;
      },
      "This worker's own hang timeout in seconds as set by set_hang_timeout (0: none, the "
      "launcher's applies; also 0 outside elasticrun).");
  m.def(
      "heartbeat_slot",
      []() -> std::optional<uint32_t> {
        if (!resolve()) throw py::error_already_set();
        if (g_heartbeat == nullptr) return std::nullopt;
        return g_heartbeat->slot();
      },
      "The heartbeat slot this process beats into, or None outside elasticrun.");
  m.def(
      "detach",
      []() {
        if (g_heartbeat != nullptr) g_heartbeat->detach();
        g_resolved = Resolved::kAbsent;
      },
      "Mark this worker finished: later beats are no-ops and no hang is reported for it.");
}

}  // namespace

void register_heartbeat(py::module_& m) {
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
  register_slot(m);
  register_table(m);
  register_handle(m);
  register_own_slot(m);
}

}  // namespace elastic_py
