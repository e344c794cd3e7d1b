// LocalBarrier and TcpBarrier. Waits release the GIL.
#include <pybind11/stl.h>

#include "common.hpp"

namespace elastic_py {
namespace {

struct PyBarrier {
  std::shared_ptr<elastic::LocalBarrier> barrier;
  elastic::LocalBarrier& get() const {
    if (!barrier) throw py::value_error("the barrier is closed");
    return *barrier;
  }
};

struct PyTcpBarrier {
  std::unique_ptr<elastic::TcpBarrier> barrier;
  elastic::TcpBarrier& get() const {
    if (!barrier) throw py::value_error("the TCP barrier is closed");
    return *barrier;
  }
};

}  // namespace

std::shared_ptr<elastic::LocalBarrier> barrier_of(const py::object& obj) {
  return obj.cast<const PyBarrier&>().barrier;
}

namespace {

void register_local(py::module_& m) {
  py::class_<PyBarrier>(m, "LocalBarrier",
                        "A shared-memory barrier among the processes of one node. The "
                        "supervisor creates it; each participant opens it with its index.")
      .def_static(
          "create",
          [](const std::string& path, uint32_t parties) {
            return PyBarrier{std::make_shared<elastic::LocalBarrier>(
                elastic::LocalBarrier::create(path, parties))};
          },
          py::arg("path"), py::arg("parties"))
      .def_static(
          "open",
          [](const std::string& path, uint32_t index) {
            return PyBarrier{std::make_shared<elastic::LocalBarrier>(
                elastic::LocalBarrier::open(path, index))};
          },
          py::arg("path"), py::arg("index"))
      .def(
          "wait",
          [](PyBarrier& b, std::optional<double> timeout) {
            int ms = timeout_ms(timeout, "timeout");
            elastic::LocalBarrier& barrier = b.get();
            py::gil_scoped_release nogil;
            barrier.wait(ms);
          },
          py::arg("timeout") = py::none(),
          "Wait for every participant (timeout in seconds, None: no limit). Raises "
          "BarrierAbortedError or WaitTimeoutError naming the participant at fault.")
      .def(
          "abort",
          [](PyBarrier& b, int32_t participant, const std::string& reason) {
            b.get().abort(participant, reason);
          },
          py::arg("participant"), py::arg("reason"))
      .def("reset", [](PyBarrier& b) { b.get().reset(); })
      .def_property_readonly("parties", [](const PyBarrier& b) { return b.get().parties(); })
      .def_property_readonly("rounds", [](const PyBarrier& b) { return b.get().rounds(); })
      .def_property_readonly("aborted", [](const PyBarrier& b) { return b.get().aborted(); })
      .def_property_readonly("index",
                             [](const PyBarrier& b) -> std::optional<int32_t> {
                               int32_t i = b.get().index();
                               if (i < 0) return std::nullopt;
                               return i;
                             })
      .def_property_readonly("path", [](const PyBarrier& b) { return b.get().path(); })
      .def("close", [](PyBarrier& b) { b.barrier.reset(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyBarrier& b, const py::args&) { b.barrier.reset(); });
}

void register_tcp(py::module_& m) {
  py::class_<PyTcpBarrier>(m, "TcpBarrier",
                           "A barrier among node leaders over TCP. Rank 0 listens on peers[0]; "
                           "the others connect to it.")
      .def(py::init([](std::vector<std::string> peers, uint32_t rank, const std::string& token,
                       std::optional<double> connect_timeout) {
             int ms = timeout_ms(connect_timeout, "connect_timeout");
             py::gil_scoped_release nogil;
             return PyTcpBarrier{
                 std::make_unique<elastic::TcpBarrier>(std::move(peers), rank, token, ms)};
           }),
           py::arg("peers"), py::arg("rank"), py::arg("token") = "",
           py::arg("connect_timeout") = 30.0)
      .def(
          "wait",
          [](PyTcpBarrier& b, std::optional<double> timeout) {
            int ms = timeout_ms(timeout, "timeout");
            elastic::TcpBarrier& barrier = b.get();
            py::gil_scoped_release nogil;
            barrier.wait(ms);
          },
          py::arg("timeout") = py::none())
      .def_property_readonly("rank", [](const PyTcpBarrier& b) { return b.get().rank(); })
      .def_property_readonly("size", [](const PyTcpBarrier& b) { return b.get().size(); })
      .def_property_readonly("rounds", [](const PyTcpBarrier& b) { return b.get().rounds(); })
      .def_property_readonly("bound_port",
                             [](const PyTcpBarrier& b) { return b.get().bound_port(); })
      .def("close", [](PyTcpBarrier& b) { b.barrier.reset(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyTcpBarrier& b, const py::args&) { b.barrier.reset(); });
}

}  // namespace

void register_barrier(py::module_& m) {
  register_local(m);
  register_tcp(m);
}

}  // namespace elastic_py
