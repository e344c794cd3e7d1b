#include <cmath>
#include <map>

#include "common.hpp"

namespace elastic_py {
namespace {

// Exception classes by status code; created once, at import.
std::map<int, PyObject*>& classes() {
  static std::map<int, PyObject*> map;
  return map;
}
PyObject* g_base = nullptr;

PyObject* make_class(py::module_& m, const char* name, PyObject* bases, const char* doc) {
  std::string qualified = std::string("elastic_core.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(cls));
  return cls;
}

PyObject* derived(py::module_& m, const char* name, PyObject* builtin, const char* doc) {
  PyObject* bases =
      builtin != nullptr ? PyTuple_Pack(2, g_base, builtin) : PyTuple_Pack(1, g_base);
  PyObject* cls = make_class(m, name, bases, doc);
  Py_DECREF(bases);
  return cls;
}

}  // namespace

void register_errors(py::module_& m) {
  g_base = make_class(m, "ElasticError", PyExc_Exception,
                      "Base of every error raised by elastic_core. `status` is the C status "
                      "name; `culprit` the participant or peer at fault, or None.");
  auto& c = classes();
  c[ELASTIC_ERR_INVALID_ARGUMENT] =
      derived(m, "InvalidArgumentError", PyExc_ValueError, "An argument is out of range.");
  c[ELASTIC_ERR_BAD_FILE] = derived(m, "BadFileError", nullptr,
                                    "A shared-memory file is missing, foreign, truncated or of "
                                    "another layout version.");
  c[ELASTIC_ERR_TIMEOUT] =
      derived(m, "WaitTimeoutError", PyExc_TimeoutError, "A wait ran out of time.");
  c[ELASTIC_ERR_ABORTED] = derived(m, "BarrierAbortedError", nullptr,
                                   "A barrier was aborted; `culprit` names the participant.");
  c[ELASTIC_ERR_NETWORK] = derived(m, "PeerError", PyExc_ConnectionError,
                                   "A TCP peer is unreachable or broke the protocol; `culprit` "
                                   "is its rank.");
  c[ELASTIC_ERR_NOT_AVAILABLE] =
      derived(m, "NotAvailableError", nullptr, "A facility is not available on this machine.");
  c[ELASTIC_ERR_NOT_FOUND] =
      derived(m, "NotFoundError", PyExc_LookupError, "No such worker, process or device.");
  c[ELASTIC_ERR_STATE] =
      derived(m, "StateError", nullptr, "The call is not valid in the object's current state.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const elastic::Error& e) {
      set_python_error(e);
    }
  });
}

void set_python_error(const elastic::Error& e) {
  auto it = classes().find(e.status());
  PyObject* cls = it != classes().end() ? it->second : g_base;
  PyObject* exc = PyObject_CallFunction(cls, "s", e.what());
  if (exc == nullptr) return;  // the error indicator is set already
  PyObject* status = PyUnicode_FromString(elastic_status_name(e.status()));
  PyObject_SetAttrString(exc, "status", status);
  Py_XDECREF(status);
  if (e.culprit() >= 0) {
    PyObject* culprit = PyLong_FromLong(e.culprit());
    PyObject_SetAttrString(exc, "culprit", culprit);
    Py_XDECREF(culprit);
  } else {
    PyObject_SetAttrString(exc, "culprit", Py_None);
  }
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
}

int timeout_ms(const std::optional<double>& seconds, const char* name) {
  if (!seconds) return -1;
  double s = *seconds;
  if (!std::isfinite(s) || s < 0 || s > 2e6) {
    throw py::value_error(std::string(name) + "=" + py::repr(py::float_(s)).cast<std::string>() +
                          " is not a timeout: give seconds from 0 to 2000000, or None for no "
                          "limit");
  }
  return static_cast<int>(std::ceil(s * 1000.0));
}

uint64_t duration_ms(double seconds, const char* name) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 1e9) {
    throw py::value_error(std::string(name) + "=" +
                          py::repr(py::float_(seconds)).cast<std::string>() +
                          " is not a duration: give seconds, 0 or more");
  }
  return static_cast<uint64_t>(std::ceil(seconds * 1000.0));
}

}  // namespace elastic_py
