// GpuHealth and GpuReport.
#include <pybind11/stl.h>

#include "common.hpp"

namespace elastic_py {
namespace {

enum class GpuFault : uint32_t {
  NONE = 0,
  LOST = ELASTIC_GPU_FAULT_LOST,
  XID = ELASTIC_GPU_FAULT_XID,
  ECC = ELASTIC_GPU_FAULT_ECC,
  RETIRED_PAGES = ELASTIC_GPU_FAULT_RETIRED_PAGES,
  ROW_REMAP = ELASTIC_GPU_FAULT_ROW_REMAP,
  THERMAL = ELASTIC_GPU_FAULT_THERMAL,
  HW_SLOWDOWN = ELASTIC_GPU_FAULT_HW_SLOWDOWN,
};

struct PyGpu {
  std::shared_ptr<elastic::GpuHealth> gpu;
};

}  // namespace

std::shared_ptr<elastic::GpuHealth> gpu_of(const py::object& obj) {
  return obj.cast<const PyGpu&>().gpu;
}

namespace {

// What a check finds: the states, the fault bits, one GPU's report.
void register_report(py::module_& m) {
  py::native_enum<elastic_gpu_state>(m, "GpuState", "enum.IntEnum", "Health of NVML or a GPU.")
      .value("HEALTHY", ELASTIC_GPU_HEALTHY)
      .value("UNHEALTHY", ELASTIC_GPU_UNHEALTHY)
      .value("UNKNOWN", ELASTIC_GPU_UNKNOWN)
      .value("NOT_AVAILABLE", ELASTIC_GPU_NOT_AVAILABLE)
      .finalize();
  py::native_enum<GpuFault>(m, "GpuFault", "enum.IntFlag", "GPU fault bits.")
      .value("NONE", GpuFault::NONE)
      .value("LOST", GpuFault::LOST)
      .value("XID", GpuFault::XID)
      .value("ECC", GpuFault::ECC)
      .value("RETIRED_PAGES", GpuFault::RETIRED_PAGES)
      .value("ROW_REMAP", GpuFault::ROW_REMAP)
      .value("THERMAL", GpuFault::THERMAL)
      .value("HW_SLOWDOWN", GpuFault::HW_SLOWDOWN)
      .finalize();

  py::class_<elastic::GpuReport>(m, "GpuReport", "The result of checking one GPU.")
      .def_readonly("device", &elastic::GpuReport::device)
      .def_readonly("state", &elastic::GpuReport::state)
      .def_property_readonly("faults",
                             [](const elastic::GpuReport& r) {
                               return static_cast<GpuFault>(r.faults);
                             })
      .def_readonly("last_xid", &elastic::GpuReport::last_xid)
      .def_readonly("ecc_uncorrected", &elastic::GpuReport::ecc_uncorrected)
      .def_readonly("time_ns", &elastic::GpuReport::time_ns)
      .def_readonly("detail", &elastic::GpuReport::detail)
      .def("__repr__", [](const elastic::GpuReport& r) {
        return "GpuReport(device=" + std::to_string(r.device) + ", state=" +
               py::repr(py::cast(r.state)).cast<std::string>() + ", detail=" +
               py::repr(py::str(r.detail)).cast<std::string>() + ")";
      });
}

void register_checker(py::module_& m) {
  py::class_<PyGpu>(m, "GpuHealth",
                    "NVML loaded at run time. A missing library is not an error: `state` is "
                    "NOT_AVAILABLE. Calls into NVML run on a helper thread with a deadline, so a "
                    "stuck driver gives UNKNOWN instead of a hang.")
      .def(py::init([](std::optional<std::string> library, std::optional<double> timeout) {
             int ms = timeout_ms(timeout, "timeout");
             py::gil_scoped_release nogil;
             return PyGpu{elastic::GpuHealth::open(library.value_or(""), ms)};
           }),
           py::arg("library") = py::none(), py::arg("timeout") = 2.0)
      .def_property_readonly("state", [](const PyGpu& g) { return g.gpu->state(); })
      .def_property_readonly("detail", [](const PyGpu& g) { return g.gpu->detail(); })
      .def_property_readonly("library_path", [](const PyGpu& g) { return g.gpu->library_path(); })
      .def_property_readonly("device_count", [](const PyGpu& g) { return g.gpu->device_count(); })
      .def(
          "check",
          [](PyGpu& g, uint32_t device, std::optional<double> timeout) {
            int ms = timeout_ms(timeout, "timeout");
            py::gil_scoped_release nogil;
            return g.gpu->check(device, ms);
          },
          py::arg("device"), py::arg("timeout") = 2.0)
      .def(
          "check_all",
          [](PyGpu& g, std::optional<double> timeout) {
            int ms = timeout_ms(timeout, "timeout");
            py::gil_scoped_release nogil;
            return g.gpu->check_all(ms);
          },
          py::arg("timeout") = 2.0);
}

}  // namespace

void register_gpu_health(py::module_& m) {
  register_report(m);
  register_checker(m);
}

}  // namespace elastic_py
