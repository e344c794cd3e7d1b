// elastic_core._core: Python bindings of the ElasticCore C++ library.
#include "common.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "Bindings of ElasticCore: heartbeats, watchdog, GPU health, barriers, checksums.";
  elastic_py::register_errors(m);
  elastic_py::register_heartbeat(m);
  elastic_py::register_gpu_health(m);
  elastic_py::register_barrier(m);
  elastic_py::register_watchdog(m);
  elastic_py::register_checksum(m);

  m.attr("ABI_VERSION") = elastic_abi_version();
  m.attr("LIBRARY_VERSION") = elastic_version();
  m.attr("HEARTBEAT_FILE_ENV") = ELASTIC_ENV_HEARTBEAT_FILE;
  m.attr("HEARTBEAT_SLOT_ENV") = ELASTIC_ENV_HEARTBEAT_SLOT;
  m.attr("NVML_LIBRARY_ENV") = ELASTIC_ENV_NVML_LIBRARY;
  m.def("now_ns", &elastic::now_ns, "CLOCK_MONOTONIC in nanoseconds: the clock of every event.");
}
