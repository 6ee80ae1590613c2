// pybind11 module megazero.ops._sign_pack: the 1-bit sign codec of the compressed all-reduce
// (pack fp32 signs 8 to a byte, unpack bytes into +-scale with per-chunk scales).
//
// Functions take raw addresses (tensor.data_ptr()) and sizes from megazero/ops/sign_pack.py,
// never torch objects, so the module does not link libtorch. The kernel table is chosen per
// call from the active SIMD level (megazero/cpu_dispatch.h; set_simd_level() forces one, and
// MEGAZERO_SIMD is applied by megazero.ops._cpu_ext on load).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "megazero/binding.h"
#include "megazero/cpu_dispatch.h"
#include "sign_pack_common.h"

namespace py = pybind11;
using namespace megazero_sign_pack;

namespace {

const KernelTable* const kTables[] = MZ_SIMD_TABLES(megazero_sign_pack, kTable);

const KernelTable& table() { return megazero::active_table(kTables); }

template <class T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

PYBIND11_MODULE(_sign_pack, m) {
  m.doc() = "megazero 1-bit sign codec (CPU): raw-pointer kernels with run-time SIMD dispatch";

  megazero::binding::def_simd_functions(m);

  m.def(
      "pack_signs",
      [](uintptr_t x, uintptr_t out, int64_t n, int nt) {
        if (n < 0) throw std::invalid_argument("pack_signs: negative size");
        py::gil_scoped_release release;
        table().pack(ptr<const float>(x), ptr<uint8_t>(out), n, nt);
      },
      py::arg("x"), py::arg("out"), py::arg("n"), py::arg("nthreads"),
      "out [ceil(n/8)] uint8: bit i%8 of byte i/8 set when x[i] >= 0 (fp32 x [n])");
  m.def(
      "unpack_signs",
      [](uintptr_t packed, uintptr_t out, int64_t n, uintptr_t scales, int64_t chunk, int nt) {
        if (n < 0 || chunk < 1) throw std::invalid_argument("unpack_signs: bad sizes");
        py::gil_scoped_release release;
        table().unpack(ptr<const uint8_t>(packed), ptr<float>(out), n, ptr<const float>(scales),
                       chunk, nt);
      },
      py::arg("packed"), py::arg("out"), py::arg("n"), py::arg("scales"), py::arg("chunk"),
      py::arg("nthreads"),
      "out [n] fp32 = scales[i/chunk] where bit i of packed is set, -scales[i/chunk] elsewhere");
}
