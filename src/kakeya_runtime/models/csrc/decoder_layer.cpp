// One decoder layer's decode step in one call: kakeya::decoder_layer.
//
// N rows, one new token each (a decode step of one session, or the rows of a batched step), each over its own
// preallocated cache (`append_slot`: kv.cache's full and ring layers, sink_window's identity ring). The eager step
// otherwise runs ~9 ops per layer from Python with their views and glue (~8 ms of a 25 ms SmolLM2 step at 1k); here
// the same ops run back to back: norm -> QKV projection -> qkv_rope (Gemma's q/k norms) -> attention with the K/V
// write -> o_proj -> (Gemma's post-attention norm) -> add + norm -> gate/up -> act(gate) * up -> down -> (Gemma's
// post-feedforward norm) -> residual add. Each is the very function its op runs (common.h), on the same inputs, in
// layers.py's order, so the bits are the Python path's by construction (tests/models/test_native_layer.py compares
// them).
//
// Arguments prepared once per layer (models/native_layer.py): weights [input norm, post-attention norm, pre-feedforward
// norm, post-feedforward norm, q norm, k norm, then (w or codes, scales, bias) for qkv, o, gate/up, down], an empty
// tensor where a layer has none; config [gemma, heads, kv_heads, head_dim, unit_offset, act, fmt x 4] (fmt 0: dense
// kakeya::linear, 4 / 8: kakeya::quant_linear int4 / int8, its bias added after as QuantLinear does); params
// [eps, q/k norm eps, attention scale]. Per step: h (N, 1, C), cos / sin (N, D) the rows' RoPE rows, q_pos (N,),
// and the caches' buffers and slots as kakeya::cached_attention_rows_append takes them.
//
// Rows over a policy cache (its own writes or its own attention, in Python) take the same layer in two calls around
// that attention: kakeya::decoder_layer_attention_inputs (norm -> QKV -> qkv_rope: q, k_new, v_new) and
// kakeya::decoder_layer_output (attention output -> o_proj -> ... -> residual add), the very halves decoder_layer runs.
// A single row over a sparse cache in its steady state runs both halves and the cache's step between them in one
// call, kakeya::decoder_layer_sparse (below).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/record_function.h>

#include <torch/custom_class.h>

#include "common.h"

namespace {

enum Weight : int64_t { kInputNorm, kPostAttnNorm, kPreFfNorm, kPostFfNorm, kQNorm, kKNorm, kProj };
enum Proj : int64_t { kQkv, kO, kGateUp, kDown };
enum Config : int64_t { kGemma, kHeads, kKvHeads, kHeadDim, kUnitOffset, kAct, kFmt };

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// kakeya::quant_linear lives in quant_linear.cpp's own namespace: reached through its registered op (one
// dispatcher call, the same function).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sz, int64_t bits) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kakeya::quant_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                               const std::optional<at::Tensor>&)>();
  return op.call(x, q, sz, bits, std::nullopt);
}

// layers.Linear / DenseLinear (fmt 0: bias inside the kernel) or QuantLinear.forward's kernel path (bias after).
at::Tensor project(const at::Tensor& x, at::TensorList weights, at::IntArrayRef config, int64_t which) {
  const at::Tensor& w = weights[kProj + 3 * which];
  const at::Tensor& sz = weights[kProj + 3 * which + 1];
  const at::Tensor& bias = weights[kProj + 3 * which + 2];
  const int64_t fmt = config[kFmt + which];
  if (fmt == 0) return kakeya_ops::linear(x, w, maybe(bias), false);
  auto y = quant_linear(x, w, sz, fmt);
  return bias.numel() ? at::add(y, bias) : y;
}

void check_layer(const at::Tensor& h, at::TensorList weights, at::IntArrayRef config, at::ArrayRef<double> params) {
  TORCH_CHECK(weights.size() == kProj + 12 && config.size() == kFmt + 4 && params.size() == 3,
              "decoder_layer: weights (18), config (10) and params (3) as models/native_layer.py packs them");
  TORCH_CHECK(h.dim() == 3 && h.size(1) == 1 && h.is_contiguous(), "decoder_layer: h must be contiguous (N, 1, C)");
}

// The layer up to attention: RMSNorm.forward, then Attention.forward's rows (_split_rope): q (N, H, 1, D) and
// k_new (N, Hk, 1, D) normed (Gemma) and rotated, v_new (N, Hk, 1, D) a view of the QKV projection.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_inputs(const at::Tensor& h, const at::Tensor& cos,
                                                                const at::Tensor& sin, at::TensorList weights,
                                                                at::IntArrayRef config, at::ArrayRef<double> params) {
  check_layer(h, weights, config, params);
  const int64_t N = h.size(0), C = h.size(2), H = config[kHeads], Hk = config[kKvHeads], D = config[kHeadDim];
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == N && cos.size(1) == D && cos.is_contiguous() && sin.is_contiguous() &&
                  sin.sizes() == cos.sizes(),
              "decoder_layer: cos, sin must be contiguous (N, D)");
  const bool unit_offset = config[kUnitOffset] != 0;
  const auto x = kakeya_ops::rms_norm(h.view({N, C}), weights[kInputNorm], params[0], unit_offset);
  const auto qkv = project(x, weights, config, kQkv).view({N, 1, -1});  // (N, 1, (H + 2 Hk) D)
  auto [q, k_new] = kakeya_ops::qkv_rope(qkv, cos.view({N, 1, D}), sin.view({N, 1, D}), H, Hk,
                                         maybe(weights[kQNorm]), maybe(weights[kKNorm]), params[1], unit_offset);
  auto v_new = qkv.narrow(2, (H + Hk) * D, Hk * D).view({N, 1, Hk, D}).transpose(1, 2);  // (N, Hk, 1, D)
  return {q, k_new, v_new};
}

// The layer from attention's output att (N, H * D) on: o_proj, the block's norms and residual adds, the MLP.
at::Tensor layer_output(const at::Tensor& att, const at::Tensor& h, at::TensorList weights, at::IntArrayRef config,
                        at::ArrayRef<double> params) {
  check_layer(h, weights, config, params);
  const int64_t N = h.size(0), C = h.size(2);
  TORCH_CHECK(att.dim() == 2 && att.size(0) == N && att.size(1) == config[kHeads] * config[kHeadDim] &&
                  att.scalar_type() == h.scalar_type(),
              "decoder_layer: attention output must be (N, H * D) in h's dtype");
  const bool gemma = config[kGemma] != 0, unit_offset = config[kUnitOffset] != 0;
  const double eps = params[0];
  const auto h2 = h.view({N, C});
  const auto a = project(att, weights, config, kO);  // (N, C)
  // The block: Llama's add + norm, or Gemma's sandwich (post-attention norm, then add + pre-feedforward norm).
  auto [s, normed] = gemma ? kakeya_ops::add_rms_norm(kakeya_ops::rms_norm(a, weights[kPostAttnNorm], eps, true), h2,
                                                      weights[kPreFfNorm], eps, true)
                           : kakeya_ops::add_rms_norm(a, h2, weights[kPostAttnNorm], eps, unit_offset);
  // GatedMLP.forward: gate/up, act(gate) * up, down.
  const auto gate_up = project(normed, weights, config, kGateUp);
  auto m = project(kakeya_ops::gated_act(gate_up, config[kAct]), weights, config, kDown);
  if (gemma) m = kakeya_ops::rms_norm(m, weights[kPostFfNorm], eps, true);
  thread_local Reusable site;
  auto out = reusable_empty(site, {N, C}, h.options());
  return at::add_out(out, s, m).view({N, 1, C});
}

at::Tensor decoder_layer(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& q_pos,
                         at::TensorList weights, at::IntArrayRef config, at::ArrayRef<double> params,
                         at::TensorList k, at::TensorList v, at::TensorList k_pos, at::IntArrayRef slot,
                         at::IntArrayRef count, at::IntArrayRef write_pos, at::IntArrayRef window,
                         at::IntArrayRef sink) {
  const auto [q, k_new, v_new] = attention_inputs(h, cos, sin, weights, config, params);
  const int64_t N = h.size(0), H = config[kHeads], Hk = config[kKvHeads], D = config[kHeadDim];
  const auto att = kakeya_ops::cached_attention_rows_append(q.view({N, Hk, H / Hk, D}), k_new, v_new, k, v, k_pos,
                                                            slot, count, write_pos, q_pos, window, sink, params[2]);
  return layer_output(att.view({N, H * D}), h, weights, config, params);
}

// One layer's decode rows' cache entries, as decoder_layer takes them (a stack call's slice of its layer-major lists).
struct RowsAt {
  at::TensorList k, v, k_pos;
  at::IntArrayRef slot, count, write_pos, window, sink;
};

// A stack call's decode-row cache entries, layer-major (n a layer): `at` slices out one layer's.
struct RowEntries {
  const std::vector<at::Tensor>& k;
  const std::vector<at::Tensor>& v;
  const std::vector<at::Tensor>& k_pos;
  const std::vector<int64_t>& slot;
  const std::vector<int64_t>& count;
  const std::vector<int64_t>& write_pos;
  const std::vector<int64_t>& window;
  const std::vector<int64_t>& sink;

  void check(int64_t entries, const char* what) const {
    const auto n = static_cast<size_t>(entries);
    TORCH_CHECK(k.size() == n && v.size() == n && k_pos.size() == n && slot.size() == n && count.size() == n &&
                    write_pos.size() == n && window.size() == n && sink.size() == n,
                what, ": one cache entry per layer and row (the decode rows), layer-major");
  }
  RowsAt at(int64_t first, int64_t n) const {
    return {at::TensorList(k).slice(first, n),         at::TensorList(v).slice(first, n),
            at::TensorList(k_pos).slice(first, n),     at::IntArrayRef(slot).slice(first, n),
            at::IntArrayRef(count).slice(first, n),    at::IntArrayRef(write_pos).slice(first, n),
            at::IntArrayRef(window).slice(first, n),   at::IntArrayRef(sink).slice(first, n)};
  }
};

// Decode rows and prefill chunks riding them (h (N + T, 1, C): the N decode rows, then each chunk's consecutive tokens
// of its own sequence, T in all) in one call: the layer's first half over every row, the decode rows' attention as
// decoder_layer's (cached_attention_rows_append), then chunk after chunk j (csize[j] tokens): its K/V written at its
// slots (the next csize[j] of cslot) of its cache's buffers ck[j], cv[j] (1, Hk, A, D) (and its positions at
// ckpos[j][slot] when cwrite[j]), then its tokens' attention as one query (1, Hk, G * T_j, D) over the first ccount[j]
// slots (kakeya::cached_attention: each token sees by position, at or before its own and within cwindow[j] /
// csink[j], so the chunk's later keys are out of its earlier tokens' view), then the second half over every row. The
// Python path's run_mixed computes the same functions on the same inputs (the halves over all rows, the rows'
// attention, each chunk's cache write then its attention): the same bits and writes.
at::Tensor decoder_layer_chunks(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& q_pos, at::TensorList weights, at::IntArrayRef config,
                                at::ArrayRef<double> params, const RowsAt& rows_at, at::TensorList ck, at::TensorList cv,
                                at::TensorList ckpos, at::IntArrayRef cslot, at::IntArrayRef csize,
                                at::IntArrayRef ccount, at::IntArrayRef cwrite, at::IntArrayRef cwindow,
                                at::IntArrayRef csink) {
  const auto [q, k_new, v_new] = attention_inputs(h, cos, sin, weights, config, params);
  const int64_t R = h.size(0), T = int64_t(cslot.size()), N = R - T, J = int64_t(csize.size());
  const int64_t H = config[kHeads], Hk = config[kKvHeads], D = config[kHeadDim], G = H / Hk;
  int64_t sized = 0;
  bool sizes_ok = true;
  for (const int64_t t : csize) {  // each size checked against what is left before it is added (no overflow)
    sizes_ok = sizes_ok && t >= 1 && t <= T - sized;
    if (sizes_ok) sized += t;
  }
  TORCH_CHECK(J >= 1 && sizes_ok && sized == T && N >= 0 && q_pos.dim() == 1 && q_pos.size(0) == R && q_pos.is_contiguous() &&
                  int64_t(ck.size()) == J && int64_t(cv.size()) == J && int64_t(ckpos.size()) == J &&
                  int64_t(ccount.size()) == J && int64_t(cwrite.size()) == J && int64_t(cwindow.size()) == J &&
                  int64_t(csink.size()) == J,
              "decoder_layer_chunk: chunks of at least one token after the decode rows (their sizes summing to the "
              "slots), one position per row, and each chunk's buffers, count, write flag, window and sink");
  for (int64_t j = 0; j < J; ++j) {
    TORCH_CHECK(ck[j].is_cpu() && cv[j].is_cpu() && ckpos[j].is_cpu() && ck[j].dim() == 4 && ck[j].size(0) == 1 &&
                    ck[j].size(1) == Hk && ck[j].size(3) == D &&
                    cv[j].sizes() == ck[j].sizes() && ck[j].scalar_type() == h.scalar_type() &&
                    cv[j].scalar_type() == h.scalar_type() && ck[j].stride(3) == 1 && cv[j].stride(3) == 1 &&
                    ckpos[j].dim() == 1 && ckpos[j].scalar_type() == at::kLong && ckpos[j].is_contiguous() &&
                    ckpos[j].size(0) >= ccount[j] && ccount[j] >= 1 && ccount[j] <= ck[j].size(2) &&
                    cwindow[j] >= 0 && csink[j] >= 0,
                "decoder_layer_chunk: a chunk's cache must be (1, Hk, A, D) CPU buffers of h's dtype, positions "
                "int64 (>= count,), count in [1, A], window and sink >= 0");
  }
  // every slot checked before anything is written: among the slots the chunk attends (so inside its buffers)
  for (int64_t j = 0, t = 0; j < J; ++j)
    for (const int64_t end = t + csize[j]; t < end; ++t)
      TORCH_CHECK(cslot[t] >= 0 && cslot[t] < ccount[j], "decoder_layer_chunk: slot ", cslot[t],
                  " outside the chunk's ", ccount[j], " attended slots");
  thread_local Reusable att_site;
  auto att = reusable_empty(att_site, {R, H * D}, h.options());
  if (N > 0) {
    const RowsAt& a = rows_at;
    const auto rows = kakeya_ops::cached_attention_rows_append(
        q.narrow(0, 0, N).view({N, Hk, G, D}), k_new.narrow(0, 0, N), v_new.narrow(0, 0, N), a.k, a.v, a.k_pos,
        a.slot, a.count, a.write_pos, q_pos.narrow(0, 0, N), a.window, a.sink, params[2]);
    att.narrow(0, 0, N).copy_(rows.view({N, H * D}));
  }
  const int64_t* qp = q_pos.const_data_ptr<int64_t>();
  const char* kn = static_cast<const char*>(k_new.const_data_ptr());
  const char* vn = static_cast<const char*>(v_new.const_data_ptr());
  const int64_t es = h.element_size();
  const size_t bytes = D * es;
  for (int64_t j = 0, first = N; j < J; first += csize[j], ++j) {
    const at::Tensor &kj = ck[j], &vj = cv[j];
    const int64_t Tj = csize[j];
    // The chunk's keys and values into its slots: row first + t of k_new / v_new (Hk, 1, D), each head's D values.
    char* kb = static_cast<char*>(kj.data_ptr());
    char* vb = static_cast<char*>(vj.data_ptr());
    for (int64_t t = 0; t < Tj; ++t) {
      const int64_t sl = cslot[first - N + t];
      for (int64_t hd = 0; hd < Hk; ++hd) {
        std::memcpy(kb + (hd * kj.stride(1) + sl * kj.stride(2)) * es,
                    kn + ((first + t) * k_new.stride(0) + hd * k_new.stride(1)) * es, bytes);
        std::memcpy(vb + (hd * vj.stride(1) + sl * vj.stride(2)) * es,
                    vn + ((first + t) * v_new.stride(0) + hd * v_new.stride(1)) * es, bytes);
      }
      if (cwrite[j]) ckpos[j].data_ptr<int64_t>()[sl] = qp[first + t];
    }
    // The chunk's queries as one sequence's: (T_j, H, 1, D) -> (1, H, T_j, D), read as (1, Hk, G * T_j, D).
    const auto qc = q.narrow(0, first, Tj).view({Tj, H, D}).transpose(0, 1).contiguous().view({1, Hk, G * Tj, D});
    const auto out = kakeya_ops::cached_attention(qc, kj.narrow(2, 0, ccount[j]), vj.narrow(2, 0, ccount[j]),
                                                  q_pos.narrow(0, first, Tj), ckpos[j].narrow(0, 0, ccount[j]),
                                                  cwindow[j], csink[j], params[2]);
    att.narrow(0, first, Tj).view({Tj, H, D}).copy_(out.view({H, Tj, D}).transpose(0, 1));
  }
  return layer_output(att, h, weights, config, params);
}

// One row over a sparse cache in its steady decode state (kv/sparse.py, SparseLayerKV.decoder_layer_step) in one
// call: the layer's first half, the new K/V into the hot ring (ring_write), the sparse step, the second half; the
// split path's calls in its order (the same functions on the same inputs: the same bits, the same cache writes).
// state [k_hot, v_hot, hot_pos, counters]; index [kmin, kmax, head_topk, cold_head]; geometry [slot, n_blocks,
// window, sink, block, budget_topk]. A cold tier read as stored: cold [cold_k, cold_v, cold_slot] or with int8 scales [cold_k,
// cold_v, k_scale, v_scale, cold_slot], `decoded` empty (kakeya::sparse_step). A D4 tier: cold [k_code, k_scale,
// v_code, v_scale, rot], decoded [block_slot, slot_block, slot_used, dec_k, dec_v], lattice [step, q, bits, codes]
// (kakeya::sparse_step_decoded). Returns (the layer's output (1, 1, C), select, hits, misses, q (1, Hk, G, D)); when
// the decoded cache cannot hold the step's blocks (misses -1) the output is empty, only the ring was written, and the
// caller finishes the step from q (its oversize path) and kakeya::decoder_layer_output.
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t, at::Tensor> decoder_layer_sparse(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& q_pos, at::TensorList weights,
    at::IntArrayRef config, at::ArrayRef<double> params, at::TensorList state, at::TensorList cold,
    at::TensorList index, at::IntArrayRef geometry, double budget, at::TensorList decoded, at::IntArrayRef lattice) {
  TORCH_CHECK(h.size(0) == 1 && q_pos.numel() == 1, "decoder_layer_sparse: one row, one token");
  TORCH_CHECK(state.size() == 4 && index.size() == 4 && geometry.size() == 6,
              "decoder_layer_sparse: state (4), index (4) and geometry (6) as kv/sparse.py packs them");
  TORCH_CHECK(decoded.empty() ? (cold.size() == 3 || cold.size() == 5) : (cold.size() == 5 && decoded.size() == 5 &&
                                                                          lattice.size() == 4),
              "decoder_layer_sparse: cold (3 or 5) for a tier read as stored; cold (5), decoded (5), lattice (4) "
              "for a D4 tier");
  const auto [q, k_new, v_new] = attention_inputs(h, cos, sin, weights, config, params);
  const int64_t H = config[kHeads], Hk = config[kKvHeads], D = config[kHeadDim];
  const int64_t slot = geometry[0], n_blocks = geometry[1], window = geometry[2], sink = geometry[3],
                block = geometry[4], budget_topk = geometry[5];
  const double scale = params[2];
  kakeya_ops::ring_write(state[0], state[1], state[2], k_new, v_new, q_pos, slot);
  const auto qg = q.reshape({1, Hk, H / Hk, D}).contiguous();  // rows (group, token), as SparseLayerKV.attend
  at::Tensor out, select;
  int64_t hits = 0, misses = 0;
  if (decoded.empty()) {
    const bool int8 = cold.size() == 5;
    std::tie(out, select) = kakeya_ops::sparse_step(
        qg, state[0], state[1], state[2], cold[0], cold[1], int8 ? std::optional<at::Tensor>(cold[2]) : std::nullopt,
        int8 ? std::optional<at::Tensor>(cold[3]) : std::nullopt, cold[int8 ? 4 : 2], index[3], index[0], index[1],
        n_blocks, index[2], q_pos, window, sink, block, scale, state[3], budget, budget_topk);
  } else {
    std::tie(out, select, hits, misses) = kakeya_ops::sparse_step_decoded(
        qg, state[0], state[1], state[2], index[3], index[0], index[1], n_blocks, index[2], q_pos, window, sink, block,
        scale, state[3], budget, decoded[0], decoded[1], decoded[2], lattice[0], cold[0], cold[1], cold[2], cold[3],
        cold[4], decoded[3], decoded[4], lattice[1], lattice[2], lattice[3], std::nullopt, budget_topk);
    if (misses < 0) return {at::empty({0}, h.options()), select, hits, misses, qg};
  }
  return {layer_output(out.view({1, H * D}), h, weights, config, params), select, hits, misses, qg};
}

// A model's decode layers in one call per step: kakeya.DecoderStack, built once from every layer's arguments (the
// per-layer weights, config and params decoder_layer takes, concatenated), stepping all rows through all layers with
// decoder_layer itself, layer after layer. A step crossed Python, the dispatcher's argument boxing and the model's
// loop once per layer while the second thread waited; now once (with the narrow few-row tiles, SmolLM2 int4 decode
// +27-33% at 1k in the engine bench, trees alternated: results/engine/decode_v10_ab).
// Per step: h (N, 1, C); cos, sin one (N, D) table per layer; the caches' buffers and slots as decoder_layer takes
// them, layer-major (layer l's rows at l * N ..).
struct DecoderStack : torch::CustomClassHolder {
  static constexpr int64_t kWeights = kProj + 12, kConfig = kFmt + 4, kParams = 3;
  std::vector<at::Tensor> weights;
  std::vector<int64_t> config;
  std::vector<double> params;
  int64_t layers;

  DecoderStack(std::vector<at::Tensor> w, std::vector<int64_t> c, std::vector<double> p)
      : weights(std::move(w)), config(std::move(c)), params(std::move(p)), layers(int64_t(config.size()) / kConfig) {
    TORCH_CHECK(layers > 0 && int64_t(config.size()) == layers * kConfig &&
                    int64_t(weights.size()) == layers * kWeights && int64_t(params.size()) == layers * kParams,
                "DecoderStack: weights (18), config (10) and params (3) per layer, as models/native_layer.py packs them");
  }

  at::TensorList weights_of(int64_t l) const { return at::TensorList(weights).slice(l * kWeights, kWeights); }
  at::IntArrayRef config_of(int64_t l) const { return at::IntArrayRef(config).slice(l * kConfig, kConfig); }
  at::ArrayRef<double> params_of(int64_t l) const { return at::ArrayRef<double>(params).slice(l * kParams, kParams); }

  // decoder_layer for layer l over its decode rows' entries.
  at::Tensor layer(int64_t l, const at::Tensor& h, const std::vector<at::Tensor>& cos,
                   const std::vector<at::Tensor>& sin, const at::Tensor& q_pos, const RowsAt& a) const {
    return decoder_layer(h, cos[l], sin[l], q_pos, weights_of(l), config_of(l), params_of(l), a.k, a.v, a.k_pos,
                         a.slot, a.count, a.write_pos, a.window, a.sink);
  }

  at::Tensor step(at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor q_pos,
                  std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<at::Tensor> k_pos,
                  std::vector<int64_t> slot, std::vector<int64_t> count, std::vector<int64_t> write_pos,
                  std::vector<int64_t> window, std::vector<int64_t> sink) {
    const int64_t N = h.size(0);
    TORCH_CHECK(int64_t(cos.size()) == layers && int64_t(sin.size()) == layers,
                "DecoderStack.step: one cos and one sin table per layer");
    const RowEntries rows{k, v, k_pos, slot, count, write_pos, window, sink};
    rows.check(layers * N, "DecoderStack.step");
    RECORD_FUNCTION("kakeya::DecoderStack.step", std::vector<c10::IValue>());  // a scope for the profiler
    const ReuseScope reuse;  // the layers' outputs come from their call sites' kept ones (common.h)
    for (int64_t l = 0; l < layers; ++l) h = layer(l, h, cos, sin, q_pos, rows.at(l * N, N));
    return h.clone();  // the step's one allocation: the caller's own copy, so the kept one stays in the step
  }

  // `step` for decode rows and prefill chunks riding them (decoder_layer_chunks, layer after layer): h (N + T, 1, C),
  // q_pos (N + T,); the decode rows' entries as `step` takes them (layer-major, N a layer); csize the chunks' token
  // counts (J chunks, T tokens in all); the chunks' buffers ck, cv, ckpos, count, write flag, window and sink J per
  // layer, and their T slots a layer (layer-major, chunk after chunk).
  at::Tensor step_chunk(at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor q_pos,
                        std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<at::Tensor> k_pos,
                        std::vector<int64_t> slot, std::vector<int64_t> count, std::vector<int64_t> write_pos,
                        std::vector<int64_t> window, std::vector<int64_t> sink, std::vector<int64_t> csize,
                        std::vector<at::Tensor> ck, std::vector<at::Tensor> cv, std::vector<at::Tensor> ckpos,
                        std::vector<int64_t> cslot, std::vector<int64_t> ccount, std::vector<int64_t> cwrite,
                        std::vector<int64_t> cwindow, std::vector<int64_t> csink) {
    const int64_t J = int64_t(csize.size()), e = layers * J;
    const int64_t T = layers > 0 ? int64_t(cslot.size()) / layers : 0, N = h.size(0) - T;
    TORCH_CHECK(int64_t(cos.size()) == layers && int64_t(sin.size()) == layers,
                "DecoderStack.step_chunk: one cos and one sin table per layer");
    TORCH_CHECK(J >= 1 && T >= 1 && N >= 0 && int64_t(cslot.size()) == layers * T && int64_t(ck.size()) == e &&
                    int64_t(cv.size()) == e && int64_t(ckpos.size()) == e && int64_t(ccount.size()) == e &&
                    int64_t(cwrite.size()) == e && int64_t(cwindow.size()) == e && int64_t(csink.size()) == e,
                "DecoderStack.step_chunk: the chunks' buffers, count, write flag, window and sink per layer, and "
                "their slots, T a layer, after the decode rows");
    const RowEntries rows{k, v, k_pos, slot, count, write_pos, window, sink};
    rows.check(layers * N, "DecoderStack.step_chunk");
    RECORD_FUNCTION("kakeya::DecoderStack.step_chunk", std::vector<c10::IValue>());
    const ReuseScope reuse;
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t c = l * J;
      h = decoder_layer_chunks(h, cos[l], sin[l], q_pos, weights_of(l), config_of(l), params_of(l), rows.at(l * N, N),
                               at::TensorList(ck).slice(c, J), at::TensorList(cv).slice(c, J),
                               at::TensorList(ckpos).slice(c, J), at::IntArrayRef(cslot).slice(l * T, T), csize,
                               at::IntArrayRef(ccount).slice(c, J), at::IntArrayRef(cwrite).slice(c, J),
                               at::IntArrayRef(cwindow).slice(c, J), at::IntArrayRef(csink).slice(c, J));
    }
    return h.clone();
  }

  // One row whose layers hold either a preallocated cache (as `step` takes them) or a sparse cache in its steady
  // decode state (kv/sparse.py, SparseLayerKV.stack_kind, stack_step): each layer as decoder_layer or
  // decoder_layer_sparse runs it, layer after layer, in one call (a sparse step crossed Python and the dispatcher
  // once per layer). kinds[l]: 0 a preallocated cache (its entry in k .. sink, in order among those layers), 1 a
  // sparse layer whose cold tier is read as stored, 2 one with a D4 tier (entries in state, cold (cold_n[i] each),
  // index, geometry, budget and, for 2, decoded and lattice, in order among the sparse layers). A steady step's
  // selection always fits its decoded-block cache (stack_kind checks it), so a refusal (misses -1) raises. Returns
  // (h, hits, misses), the D4 layers' decoded-block counts in order.
  std::tuple<at::Tensor, std::vector<int64_t>, std::vector<int64_t>> step_sparse(
      at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor q_pos,
      std::vector<int64_t> kinds, std::vector<at::Tensor> k, std::vector<at::Tensor> v,
      std::vector<at::Tensor> k_pos, std::vector<int64_t> slot, std::vector<int64_t> count,
      std::vector<int64_t> write_pos, std::vector<int64_t> window, std::vector<int64_t> sink,
      std::vector<at::Tensor> state, std::vector<at::Tensor> cold, std::vector<int64_t> cold_n,
      std::vector<at::Tensor> index, std::vector<int64_t> geometry, std::vector<double> budget,
      std::vector<at::Tensor> decoded, std::vector<int64_t> lattice) {
    TORCH_CHECK(h.size(0) == 1, "DecoderStack.step_sparse: one row");
    TORCH_CHECK(int64_t(cos.size()) == layers && int64_t(sin.size()) == layers && int64_t(kinds.size()) == layers,
                "DecoderStack.step_sparse: one cos, sin and kind per layer");
    int64_t rings = 0, sparse = 0, d4 = 0, cold_total = 0;
    for (const int64_t kind : kinds) {
      TORCH_CHECK(kind >= 0 && kind <= 2, "DecoderStack.step_sparse: kinds are 0, 1 or 2");
      rings += kind == 0, sparse += kind != 0, d4 += kind == 2;
    }
    TORCH_CHECK(int64_t(cold_n.size()) == sparse, "DecoderStack.step_sparse: one cold count per sparse layer");
    for (const int64_t n : cold_n) cold_total += n;
    const RowEntries rows{k, v, k_pos, slot, count, write_pos, window, sink};
    rows.check(rings, "DecoderStack.step_sparse");  // one a preallocated layer
    TORCH_CHECK(int64_t(state.size()) == 4 * sparse && int64_t(index.size()) == 4 * sparse &&
                    int64_t(geometry.size()) == 6 * sparse && int64_t(budget.size()) == sparse &&
                    int64_t(cold.size()) == cold_total && int64_t(decoded.size()) == 5 * d4 &&
                    int64_t(lattice.size()) == 4 * d4,
                "DecoderStack.step_sparse: state (4), index (4), geometry (6), a budget per sparse layer, their cold "
                "tensors, and decoded (5), lattice (4) per D4 layer");
    std::vector<int64_t> hits, misses;
    int64_t r = 0, s = 0, c = 0, d = 0;
    RECORD_FUNCTION("kakeya::DecoderStack.step_sparse", std::vector<c10::IValue>());
    const ReuseScope reuse;
    for (int64_t l = 0; l < layers; ++l) {
      if (kinds[l] == 0) {
        h = layer(l, h, cos, sin, q_pos, rows.at(r++, 1));
        continue;
      }
      const bool lattice_tier = kinds[l] == 2;
      auto [out, select, hit, miss, q] = decoder_layer_sparse(
          h, cos[l], sin[l], q_pos, weights_of(l), config_of(l), params_of(l), at::TensorList(state).slice(4 * s, 4),
          at::TensorList(cold).slice(c, cold_n[s]), at::TensorList(index).slice(4 * s, 4),
          at::IntArrayRef(geometry).slice(6 * s, 6), budget[s],
          lattice_tier ? at::TensorList(decoded).slice(5 * d, 5) : at::TensorList(),
          lattice_tier ? at::IntArrayRef(lattice).slice(4 * d, 4) : at::IntArrayRef());
      TORCH_CHECK(miss >= 0, "DecoderStack.step_sparse: layer ", l, "'s decoded-block cache could not hold its step's ",
                  "blocks");
      if (lattice_tier) {
        hits.push_back(hit), misses.push_back(miss);
        ++d;
      }
      h = out;
      c += cold_n[s];
      ++s;
    }
    return {h.clone(), hits, misses};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kakeya, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("step", &DecoderStack::step)
      .def("step_chunk", &DecoderStack::step_chunk)
      .def("step_sparse", &DecoderStack::step_sparse);
  m.def("decoder_layer_sparse(Tensor h, Tensor cos, Tensor sin, Tensor q_pos, Tensor[] weights, int[] config, "
        "float[] params, Tensor(a!)[] state, Tensor[] cold, Tensor[] index, int[] geometry, float budget, "
        "Tensor(b!)[] decoded, int[] lattice) -> (Tensor, Tensor, int, int, Tensor)");
  m.def("decoder_layer(Tensor h, Tensor cos, Tensor sin, Tensor q_pos, Tensor[] weights, int[] config, "
        "float[] params, Tensor(a!)[] k, Tensor(b!)[] v, Tensor(c!)[] k_pos, int[] slot, int[] count, "
        "int[] write_pos, int[] window, int[] sink) -> Tensor");
  m.def("decoder_layer_attention_inputs(Tensor h, Tensor cos, Tensor sin, Tensor[] weights, int[] config, "
        "float[] params) -> (Tensor, Tensor, Tensor)");
  m.def("decoder_layer_output(Tensor att, Tensor h, Tensor[] weights, int[] config, float[] params) -> Tensor");
}

TORCH_LIBRARY_IMPL(kakeya, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layer_attention_inputs", &attention_inputs);
  m.impl("decoder_layer_output", &layer_output);
  m.impl("decoder_layer_sparse", &decoder_layer_sparse);
}
