// pybind11 module megazero.ops._aio: the asynchronous file I/O engine of NVMe offload (a pool
// of "megazero-aio" threads running pread/pwrite, O_DIRECT where possible; aio_common.h).
//
// Buffers arrive as raw addresses (tensor.data_ptr()) with byte counts from
// megazero/ops/aio.py, which keeps each tensor alive until its request is waited for; no torch
// objects, so the module does not link libtorch. Every call that can block releases the GIL.
// Failures come back as (errno, file offset, what) for aio.py to raise as OSError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "aio_common.h"

namespace py = pybind11;
using megazero_aio::Engine;
using megazero_aio::Failure;

namespace {

py::object failure_tuple(const Failure& f) {
  if (f.err == 0) return py::none();
  return py::make_tuple(f.err, f.offset, f.what);
}

}  // namespace

PYBIND11_MODULE(_aio, m) {
  m.doc() = "megazero asynchronous file I/O (CPU): thread pool of pread/pwrite, O_DIRECT";
  m.attr("ALIGN") = megazero_aio::kAlign;
  m.attr("THREAD_NAME") = megazero_aio::kThreadName;

  py::class_<Engine>(m, "Engine")
      .def(py::init<int, int64_t, bool>(), py::arg("num_threads"), py::arg("block_size"),
           py::arg("direct"), py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          [](Engine& e, bool write, uintptr_t address, int64_t nbytes, const std::string& path,
             int64_t offset) {
            py::gil_scoped_release release;
            return e.submit(write, reinterpret_cast<char*>(address), nbytes, path, offset);
          },
          py::arg("write"), py::arg("address"), py::arg("nbytes"), py::arg("path"),
          py::arg("offset"),
          "queue a transfer of nbytes at address to/from [offset, offset + nbytes) of path; "
          "returns the handle (an open failure completes it at once, failed)")
      .def(
          "wait",
          [](Engine& e, int64_t handle) {
            Failure f;
            {
              py::gil_scoped_release release;
              f = e.wait(handle);
            }
            return failure_tuple(f);
          },
          py::arg("handle"), "block until done; None, or (errno, offset, what) on failure")
      .def(
          "wait_all",
          [](Engine& e) {
            std::vector<std::pair<int64_t, Failure>> failed;
            {
              py::gil_scoped_release release;
              failed = e.wait_all();
            }
            py::list out;
            for (const auto& [handle, f] : failed) {
              out.append(py::make_tuple(handle, failure_tuple(f)));
            }
            return out;
          },
          "block until every request is done; [(handle, (errno, offset, what))] of failures")
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>(),
           "wait for every request, then stop and join the threads")
      .def("closed", &Engine::closed)
      .def("num_threads", &Engine::num_threads)
      .def("counters",
           [](Engine& e) {
             const auto c = e.counters();
             py::dict d;
             d["bytes_read"] = c.bytes_read;
             d["bytes_written"] = c.bytes_written;
             d["direct_bytes"] = c.direct_bytes;
             d["buffered_bytes"] = c.buffered_bytes;
             d["requests"] = c.requests;
             return d;
           })
      .def("direct_refused", &Engine::direct_refused,
           "{path: reason} of files where O_DIRECT was refused (buffered I/O used instead)");
}
