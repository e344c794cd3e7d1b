// CRC-32C and the copy that checksums as it copies, for elastic_sampler's memory tier. The
// destination is a writable buffer (bounds checked here); the source is an address and a size
// (a tensor's data_ptr()), read with the GIL released.
#include <pybind11/stl.h>

#include <string_view>
#include <tuple>
#include <vector>

#include "common.hpp"
#include "elastic/checksum.hpp"

namespace elastic_py {
namespace {

py::buffer_info writable(const py::buffer& dst, size_t size) {
  py::buffer_info info = dst.request(true);
  if (info.readonly) throw py::value_error("the destination buffer is read-only");
  auto have = static_cast<size_t>(info.size * info.itemsize);
  if (have < size) {
    throw py::value_error("the destination holds " + std::to_string(have) + " bytes, fewer than " +
                          std::to_string(size));
  }
  return info;
}

void check_chunk(size_t chunk) {
  if (chunk == 0 || chunk % 8 != 0) throw py::value_error("chunk must be a positive multiple of 8");
}

}  // namespace

void register_checksum(py::module_& m) {
  m.def(
      "crc32c",
      [](const py::buffer& data, uint32_t crc) {
        py::buffer_info info = data.request();
        auto n = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release unlocked;
        return elastic::crc32c(info.ptr, n, crc);
      },
      py::arg("data"), py::arg("crc") = 0,
      "CRC-32C of a buffer's bytes, continuing from `crc` (the GIL released).");
  m.def(
      "copy_crc32c",
      [](const py::buffer& dst, uintptr_t src, size_t size, uint32_t crc) {
        py::buffer_info info = writable(dst, size);
        py::gil_scoped_release unlocked;
        return elastic::copy_crc32c(info.ptr, reinterpret_cast<const void*>(src), size, crc);
      },
      py::arg("dst"), py::arg("src"), py::arg("size"), py::arg("crc") = 0,
      "Copy `size` bytes from the address `src` into `dst`; the CRC-32C of them, continuing from "
      "`crc` (the GIL released).");
  m.def(
      "copy_crc32c_chunks",
      [](const py::buffer& dst, uintptr_t src, size_t size, size_t chunk) {
        check_chunk(chunk);
        py::buffer_info info = writable(dst, size);
        std::vector<uint32_t> crcs((size + chunk - 1) / chunk);
        {
          py::gil_scoped_release unlocked;
          elastic::copy_crc32c_chunks(info.ptr, reinterpret_cast<const void*>(src), size, chunk,
                                      crcs.data());
        }
        return crcs;
      },
      py::arg("dst"), py::arg("src"), py::arg("size"), py::arg("chunk"),
      "Copy `size` bytes from the address `src` into `dst`; the CRC-32C of each `chunk` bytes "
      "(the GIL released; as fast as memcpy for large copies).");
  m.def(
      "copy_crc32c_gather",
      [](const py::buffer& dst, size_t size, const py::bytes& head,
         const std::vector<std::tuple<size_t, uintptr_t, size_t>>& segments, size_t chunk) {
        check_chunk(chunk);
        py::buffer_info info = writable(dst, size);
        std::string_view head_bytes = head;
        std::vector<elastic::CopySegment> all;
        all.reserve(segments.size() + 1);
        if (!head_bytes.empty()) all.push_back({0, head_bytes.data(), head_bytes.size()});
        size_t end = head_bytes.size();
        for (const auto& [offset, src, n] : segments) {
          if (offset < end || n > size || offset > size - n) {
            throw py::value_error("segment at " + std::to_string(offset) + " of " +
                                  std::to_string(n) + " bytes overlaps another or ends past " +
                                  std::to_string(size));
          }
          all.push_back({offset, reinterpret_cast<const void*>(src), n});
          end = offset + n;
        }
        if (end > size) throw py::value_error("the head is larger than the payload");
        std::vector<uint32_t> crcs((size + chunk - 1) / chunk);
        {
          py::gil_scoped_release unlocked;
          elastic::copy_crc32c_gather(info.ptr, size, all.data(), all.size(), chunk, crcs.data());
        }
        return crcs;
      },
      py::arg("dst"), py::arg("size"), py::arg("head"), py::arg("segments"), py::arg("chunk"),
      "Build `size` bytes in `dst`: `head` at 0, then each (offset, src address, n) segment "
      "(sorted; a segment whose src is its own destination is checksummed in place), zeros "
      "between; the CRC-32C of each `chunk` bytes. One call, the GIL released.");
}

}  // namespace elastic_py
