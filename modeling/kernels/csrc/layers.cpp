// A decoder's layers in one call: the ops modeling/llama.py calls one by one for each layer,
// called here in the same order on the same tensors, so the result is the same bits. The
// Python loop costs about ten calls a layer (some 2 ms a step on a 30-layer model, as much as
// a batch-1 step's attention); this loop costs one.
//
// The layers it runs: RMSNorm, a fused q|k|v projection (a bias allowed), RoPE on queries and
// keys, the cache store, attention (tree rows and sliding windows included), the output
// projection, RMSNorm with the residual add, a SiLU-gated MLP; a model with anything else
// (Gemma's sandwich norms, query and key norms, another activation) runs the Python loop.
#include <torch/extension.h>  // the DecoderStack class binding

#include <memory>
#include <mutex>

#include "ops.h"

namespace {

// One projection: a weight packed for `linear` (format "") or for `linear_blocks`.
struct Projection {
  at::Tensor packed;
  int64_t num_out;
  c10::optional<at::Tensor> bias;
  std::string format;

  at::Tensor operator()(const at::Tensor& x, const std::string& path) const {
    if (format.empty()) return linear(x, packed, num_out, bias, path);
    return linear_blocks(x, packed, num_out, bias, format, path);
  }
};

struct Layer {
  Projection qkv, o, gate_up, down;
  at::Tensor post_attention_norm, next_norm;  // next_norm: the next layer's input norm, or the final norm
  int64_t rope, window;                       // indices into forward's rotations and firsts
};

constexpr int kProjections = 4;  // per layer: qkv, o, gate_up, down

class DecoderStack {
 public:
  DecoderStack(const std::vector<at::Tensor>& packed, const std::vector<int64_t>& num_out,
               const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<std::string>& formats,
               const std::vector<at::Tensor>& norms, const std::vector<int64_t>& ropes,
               const std::vector<int64_t>& windows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double scale, double eps, std::string path)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        path_(std::move(path)) {
    const size_t count = ropes.size();
    TORCH_CHECK(count > 0 && windows.size() == count && norms.size() == 2 * count &&
                    packed.size() == kProjections * count && num_out.size() == packed.size() &&
                    biases.size() == packed.size() && formats.size() == packed.size(),
                "a decoder stack takes, per layer, 4 projections (weight, outputs, bias, format), 2 norms, a rope "
                "and a window");
    auto projection = [&](size_t at) { return Projection{packed[at], num_out[at], biases[at], formats[at]}; };
    for (size_t i = 0; i < count; ++i) {
      const size_t at = kProjections * i;
      layers_.push_back(Layer{projection(at), projection(at + 1), projection(at + 2), projection(at + 3),
                              norms[2 * i], norms[2 * i + 1], ropes[i], windows[i]});
    }
  }

  // x [N, hidden]: the residual stream, added to in place; h: its RMSNorm by the first layer's
  // input norm. keys, values: the whole cache [layers, pages, KVH, page_size, D]. cos[r], sin[r]
  // [N, D]: each distinct RoPE's rotations of the rows; firsts[w]: each distinct window's first
  // positions (None: no window). Returns the last layer's output normed by the final norm.
  at::Tensor forward(at::Tensor x, at::Tensor h, const at::Tensor& keys, const at::Tensor& values,
                     const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                     const std::vector<c10::optional<at::Tensor>>& firsts, const at::Tensor& store_pages,
                     const at::Tensor& store_offsets, const at::Tensor& tables, const at::Tensor& rows,
                     const at::Tensor& positions, const c10::optional<at::Tensor>& extra) const {
    TORCH_CHECK(keys.dim() == 5 && keys.size(0) == static_cast<int64_t>(layers_.size()) && values.sizes() == keys.sizes(),
                "the cache must be [layers, pages, kv_heads, page_size, head_dim] for this stack's ",
                layers_.size(), " layers");
    TORCH_CHECK(cos.size() == sin.size(), "one sin per cos");
    const int64_t n = h.size(0);
    const std::shared_ptr<const CacheLayers> cache = cache_layers(keys, values);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      TORCH_CHECK(layer.rope < static_cast<int64_t>(cos.size()) && layer.window < static_cast<int64_t>(firsts.size()),
                  "layer ", i, ": its rope or window is not among those given");
      at::Tensor qkv = layer.qkv(h, path_);
      rope_(qkv, cos[layer.rope], sin[layer.rope], num_heads_ + num_kv_heads_, head_dim_);
      // q, k and v as views of qkv's rows, one op each (a narrow and a view each, with a select of each layer's
      // keys and values, cost a few percent of a one-row step in tensor bookkeeping alone).
      const auto heads = [&](int64_t first, int64_t count) {
        return qkv.as_strided({n, count, head_dim_}, {qkv.stride(0), head_dim_, 1}, qkv.storage_offset() + first * head_dim_);
      };
      const at::Tensor q = heads(0, num_heads_), k = heads(num_heads_, num_kv_heads_);
      const at::Tensor v = heads(num_heads_ + num_kv_heads_, num_kv_heads_);
      at::Tensor layer_keys = cache->keys[i];  // store writes through them
      at::Tensor layer_values = cache->values[i];
      store(k, v, layer_keys, layer_values, store_pages, store_offsets);
      const c10::optional<at::Tensor>& first = firsts[layer.window];
      const at::Tensor attended =
          extra ? attend_tree(q, layer_keys, layer_values, tables, rows, positions, *extra, scale_, first)
                : attend(q, layer_keys, layer_values, tables, rows, positions, scale_, first);
      h = add_rms_norm_(x, layer.o(attended, path_), layer.post_attention_norm, eps_);
      const at::Tensor mlp = layer.down(silu_mul(layer.gate_up(h, path_)), path_);
      h = add_rms_norm_(x, mlp, layer.next_norm, eps_);
    }
    return h;
  }

 private:
  // Each layer's view of the cache, made once for the cache a worker keeps (a select per layer and step cost as
  // much as the cache store). The stack holds the last cache it was given until it is given another or destroyed;
  // shared, so that a call keeps its views while another call (another cache) replaces them.
  struct CacheLayers {
    at::Tensor keys_whole, values_whole;  // what the views were made of
    std::vector<at::Tensor> keys, values;
  };

  std::shared_ptr<const CacheLayers> cache_layers(const at::Tensor& keys, const at::Tensor& values) const {
    const auto same = [](const at::Tensor& a, const at::Tensor& b) {
      return a.is_same(b) && a.sizes() == b.sizes() && a.strides() == b.strides() && a.data_ptr() == b.data_ptr();
    };
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (!cache_ || !same(cache_->keys_whole, keys) || !same(cache_->values_whole, values)) {
      auto made = std::make_shared<CacheLayers>(CacheLayers{keys, values, {}, {}});
      for (int64_t i = 0; i < static_cast<int64_t>(layers_.size()); ++i) {
        made->keys.push_back(keys.select(0, i));
        made->values.push_back(values.select(0, i));
      }
      cache_ = std::move(made);
    }
    return cache_;
  }

  std::vector<Layer> layers_;
  mutable std::mutex cache_mutex_;
  mutable std::shared_ptr<const CacheLayers> cache_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_, eps_;
  std::string path_;
};

}  // namespace

void bind_decoder_stack(pybind11::module_& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack", "a decoder's layers, run in one call")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&,
                          const std::vector<c10::optional<at::Tensor>>&, const std::vector<std::string>&,
                          const std::vector<at::Tensor>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                          int64_t, int64_t, int64_t, double, double, std::string>(),
           pybind11::arg("packed"), pybind11::arg("num_out"), pybind11::arg("biases"), pybind11::arg("formats"),
           pybind11::arg("norms"), pybind11::arg("ropes"), pybind11::arg("windows"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"), pybind11::arg("eps"),
           pybind11::arg("path"))
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("h"), pybind11::arg("keys"),
           pybind11::arg("values"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("firsts"),
           pybind11::arg("store_pages"), pybind11::arg("store_offsets"), pybind11::arg("tables"), pybind11::arg("rows"),
           pybind11::arg("positions"), pybind11::arg("extra") = pybind11::none());
}
