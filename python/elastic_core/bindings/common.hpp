// Shared by the binding files: the Python exception types and unit conversions.
#pragma once

#include <pybind11/native_enum.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <optional>
#include <string>

#include "elastic/barrier.hpp"
#include "elastic/error.hpp"
#include "elastic/gpu_health.hpp"
#include "elastic/heartbeat.hpp"

namespace py = pybind11;

namespace elastic_py {

/// Create the exception classes in `m` and register the elastic::Error translator.
void register_errors(py::module_& m);

/// Raise the Python exception matching an elastic::Error (sets the error indicator).
void set_python_error(const elastic::Error& e);

/// Seconds (None: no limit) to a C++ millisecond timeout (-1: no limit). Rejects bad values with
/// a ValueError that quotes them.
int timeout_ms(const std::optional<double>& seconds, const char* name);

/// Seconds to whole milliseconds (>= 0), for durations that have no "no limit".
uint64_t duration_ms(double seconds, const char* name);

/// The C++ objects behind Python handles, shared so that a watchdog keeps them alive.
std::shared_ptr<elastic::HeartbeatTable> table_of(const py::object& table);
std::shared_ptr<elastic::GpuHealth> gpu_of(const py::object& gpu);
std::shared_ptr<elastic::LocalBarrier> barrier_of(const py::object& barrier);

void register_heartbeat(py::module_& m);
void register_gpu_health(py::module_& m);
void register_barrier(py::module_& m);
void register_watchdog(py::module_& m);
void register_checksum(py::module_& m);

}  // namespace elastic_py
