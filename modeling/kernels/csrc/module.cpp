// The Python module of the CPU kernels (built by modeling/native.py).
#include <torch/extension.h>

#include "ops.h"

// The kernels run without the GIL, so that a worker's heartbeat thread goes on while a long step computes.
const auto kWithoutGil = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, kWithoutGil, "attention of rows over the paged KV cache, read in place through block tables",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("tables"), py::arg("rows"), py::arg("positions"),
        py::arg("scale"), py::arg("firsts") = py::none(), py::arg("path") = "");
  m.def("attend_tree", &attend_tree, kWithoutGil, "attention of rows, token tree nodes among them, over the paged KV cache",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("tables"), py::arg("rows"), py::arg("positions"),
        py::arg("extra"), py::arg("scale"), py::arg("firsts") = py::none(), py::arg("path") = "");
  m.def("attention_paths", &attention_paths, "the attention kernel's paths in this build, fastest (the default) first");
  m.def("attention_path_for", &attention_path_for, "the path attend takes for heads of this shape: the one asked for, or generic",
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("path") = "");
  m.def("store", &store, kWithoutGil, "write rows' keys and values into pages of the KV cache");
  m.def("rms_norm", &rms_norm, kWithoutGil, "RMSNorm of each row");
  m.def("add_rms_norm_", &add_rms_norm_, kWithoutGil, "x += delta in place, then RMSNorm of each row of x");
  m.def("rope_", &rope_, kWithoutGil, "rotary embedding of the first num_heads heads of each row, in place");
  m.def("linear", &linear, kWithoutGil, "x @ W^T (+ b) on a packed weight, each row computed as it would be alone",
        py::arg("x"), py::arg("packed"), py::arg("num_out"), py::arg("bias"), py::arg("path") = "");
  m.def("linear_blocks", &linear_blocks, kWithoutGil,
        "x @ W^T (+ b) on GGUF blocks packed into panels, widened in registers, each row computed as it would be alone",
        py::arg("x"), py::arg("packed"), py::arg("num_out"), py::arg("bias"), py::arg("format"), py::arg("path") = "");
  m.def("linear_block_bytes", &linear_block_bytes, "bytes of one panel's block of 32 inputs in a block format");
  m.def("block_rows", &block_rows, kWithoutGil, "rows of a weight packed as GGUF blocks in panels, widened to float32",
        py::arg("packed"), py::arg("ids"), py::arg("format"));
  m.def("linear_panel_width", &linear_panel_width, "outputs per column panel of a packed weight");
  m.def("linear_paths", &linear_paths, "the linear kernel's instruction sets this CPU has, fastest (the default) first");
  m.def("silu_mul", &silu_mul, kWithoutGil, "silu(gate) * up of each [gate | up] row");
  m.def("set_num_threads", &specserve::set_team_threads, "threads the kernels share a call's work among (the caller and "
        "helpers that join while the call lasts; it never waits for one that has not started)", py::arg("threads"));
  m.def("get_num_threads", &specserve::team_threads, "threads the kernels share a call's work among");
  m.def("team_rests", &specserve::team_rests, "times a helper thread stood aside a while, having lost its core to "
        "another process too often");
  m.def("argmax_rows", &argmax_rows, kWithoutGil, "the first index of each float32 or bfloat16 row's largest value (a NaN's if any), as torch.argmax");
  bind_decoder_stack(m);
}
