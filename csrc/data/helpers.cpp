// Index builders of the GPT data pipeline, the two functions Megatron-LM compiles at startup.
//
// build_sample_idx: cut the token stream of the shuffled documents (doc_idx over several epochs)
//   into samples of seq_length + 1 tokens that overlap by one token; row i of the result is
//   (index into doc_idx, token offset in that document) where sample i starts, with one extra row
//   for the end of the last sample.
// build_blending_indices: Megatron's greedy blending: sample i comes from the dataset whose
//   share so far lags its weight the most; records that dataset and its running sample count.
//
// Plain pybind11 on numpy buffers (no libtorch). The numpy reference in megazero/data/helpers.py
// computes the same values; tests check that they agree exactly. Loops release the GIL.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

// The reference computes weight * n - count without fused multiply-add; so must we, for
// bit-identical choices on CPUs with FMA.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace py = pybind11;

namespace {

template <typename DocT, typename OutT>
py::array_t<OutT> build_sample_idx_impl(const py::array_t<int32_t, py::array::c_style>& sizes_,
                                        const py::array_t<DocT, py::array::c_style>& doc_idx_,
                                        int64_t seq_length, int64_t num_epochs,
                                        int64_t tokens_per_epoch) {
  if (seq_length < 1) throw py::value_error("build_sample_idx: seq_length must be >= 1");
  if (num_epochs < 1) throw py::value_error("build_sample_idx: num_epochs must be >= 1");
  if (tokens_per_epoch < 1)
    throw py::value_error("build_sample_idx: tokens_per_epoch must be >= 1");
  if (sizes_.ndim() != 1 || doc_idx_.ndim() != 1)
    throw py::value_error("build_sample_idx: sizes and doc_idx must be 1-d arrays");

  const int32_t* sizes = sizes_.data();
  const DocT* doc_idx = doc_idx_.data();
  const int64_t num_sizes = sizes_.shape(0);
  const int64_t num_docs = doc_idx_.shape(0);
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;

  py::array_t<OutT> result({num_samples + 1, static_cast<int64_t>(2)});
  OutT* out = result.mutable_data();
  std::string error;
  {
    py::gil_scoped_release release;
    int64_t doc_idx_index = 0;  // index into doc_idx
    int64_t doc_offset = 0;     // token offset inside the current document
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples && error.empty(); ++sample) {
      int64_t remaining = seq_length + 1;  // tokens still needed by this sample
      while (remaining != 0) {
        if (doc_idx_index >= num_docs) {
          error = "build_sample_idx: ran past the end of doc_idx (" + std::to_string(num_docs) +
                  " entries) at sample " + std::to_string(sample) +
                  "; tokens_per_epoch or num_epochs does not match doc_idx";
          break;
        }
        const int64_t doc_id = static_cast<int64_t>(doc_idx[doc_idx_index]);
        if (doc_id < 0 || doc_id >= num_sizes) {
          error = "build_sample_idx: doc_idx[" + std::to_string(doc_idx_index) + "] = " +
                  std::to_string(doc_id) + " is not a document of sizes (" +
                  std::to_string(num_sizes) + " entries)";
          break;
        }
        const int64_t doc_length = static_cast<int64_t>(sizes[doc_id]) - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts on its last token
          // (samples overlap by one token, the label of the last position).
          doc_offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++doc_idx_index;
          doc_offset = 0;
        }
      }
      out[2 * sample] = static_cast<OutT>(doc_idx_index);
      out[2 * sample + 1] = static_cast<OutT>(doc_offset);
    }
  }
  if (!error.empty()) throw py::value_error(error);
  return result;
}

void build_blending_indices(py::array_t<uint8_t, py::array::c_style>& dataset_index_,
                            py::array_t<int64_t, py::array::c_style>& dataset_sample_index_,
                            const py::array_t<double, py::array::c_style>& weights_,
                            int64_t num_datasets, int64_t size) {
  if (num_datasets < 1 || num_datasets > 255)
    throw py::value_error("build_blending_indices: num_datasets must be in [1, 255]");
  if (weights_.ndim() != 1 || weights_.shape(0) != num_datasets)
    throw py::value_error("build_blending_indices: weights must hold num_datasets values");
  if (dataset_index_.ndim() != 1 || dataset_index_.shape(0) < size ||
      dataset_sample_index_.ndim() != 1 || dataset_sample_index_.shape(0) < size)
    throw py::value_error("build_blending_indices: output arrays are shorter than size");

  uint8_t* dataset_index = dataset_index_.mutable_data();
  int64_t* dataset_sample_index = dataset_sample_index_.mutable_data();
  const double* weights = weights_.data();
  std::vector<int64_t> current(static_cast<size_t>(num_datasets), 0);
  py::gil_scoped_release release;
  for (int64_t i = 0; i < size; ++i) {
    const double n = i > 1 ? static_cast<double>(i) : 1.0;
    int64_t best = 0;
    double best_error = weights[0] * n - static_cast<double>(current[0]);
    for (int64_t d = 1; d < num_datasets; ++d) {
      const double error = weights[d] * n - static_cast<double>(current[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[i] = static_cast<uint8_t>(best);
    dataset_sample_index[i] = current[best];
    ++current[best];
  }
}

}  // namespace

PYBIND11_MODULE(_data, m) {
  m.doc() = "megazero data-index helpers (build_sample_idx, build_blending_indices)";
  m.def("build_sample_idx_int32", &build_sample_idx_impl<int32_t, int32_t>, py::arg("sizes"),
        py::arg("doc_idx"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"), "sample_idx [num_samples+1, 2] int32 (int32 doc_idx)");
  m.def("build_sample_idx_int64", &build_sample_idx_impl<int64_t, int64_t>, py::arg("sizes"),
        py::arg("doc_idx"), py::arg("seq_length"), py::arg("num_epochs"),
        py::arg("tokens_per_epoch"), "sample_idx [num_samples+1, 2] int64 (int64 doc_idx)");
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index").noconvert(),
        py::arg("dataset_sample_index").noconvert(), py::arg("weights"), py::arg("num_datasets"),
        py::arg("size"), "fill dataset_index (uint8) and dataset_sample_index (int64) in place");
}
