// Minimal FA3 op registration compatible with sgl_kernel 0.4.5's python/sgl_kernel/flash_attn.py
// (calls torch.ops.sgl_kernel.fwd.default with 37 args incl. sinks, sparse_mask_fine, only_qv,
//  and torch.ops.sgl_kernel.get_scheduler_metadata with 24 args).
#ifndef FLASH_OPS_NO_PYTHON
#include <Python.h>
#endif
#include <torch/all.h>
#include <torch/library.h>
#include <optional>
#include <tuple>

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mha_fwd(
    at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> k_new_, std::optional<at::Tensor> v_new_,
    std::optional<at::Tensor> q_v_, std::optional<at::Tensor> out_, std::optional<at::Tensor> cu_seqlens_q_,
    std::optional<at::Tensor> cu_seqlens_k_, std::optional<at::Tensor> cu_seqlens_k_new_,
    std::optional<at::Tensor> seqused_q_, std::optional<at::Tensor> seqused_k_, std::optional<int64_t> max_seqlen_q_,
    std::optional<int64_t> max_seqlen_k_, std::optional<at::Tensor> page_table_, std::optional<at::Tensor> kv_batch_idx_,
    std::optional<at::Tensor> leftpad_k_, std::optional<at::Tensor> rotary_cos_, std::optional<at::Tensor> rotary_sin_,
    std::optional<at::Tensor> seqlens_rotary_, std::optional<at::Tensor> q_descale_, std::optional<at::Tensor> k_descale_,
    std::optional<at::Tensor> v_descale_, std::optional<double> softmax_scale_, bool is_causal, int64_t window_size_left,
    int64_t window_size_right, int64_t attention_chunk, double softcap, bool is_rotary_interleaved,
    std::optional<at::Tensor> scheduler_metadata_, int64_t num_splits, std::optional<bool> pack_gqa_, int64_t sm_margin,
    std::optional<const at::Tensor>& sinks_, std::optional<at::Tensor> sparse_mask_fine_);

at::Tensor mha_fwd_get_scheduler_metadata(
    int64_t batch_size, int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t num_heads, int64_t num_heads_k,
    int64_t headdim, int64_t headdim_v, at::ScalarType qkv_dtype, at::Tensor seqused_k,
    std::optional<at::Tensor> cu_seqlens_q_, std::optional<at::Tensor> cu_seqlens_k_,
    std::optional<at::Tensor> cu_seqlens_k_new_, std::optional<at::Tensor> seqused_q_,
    std::optional<at::Tensor> leftpad_k_, std::optional<int64_t> page_size, int64_t max_seqlen_k_new, bool is_causal,
    int64_t window_size_left, int64_t window_size_right, int64_t attention_chunk, bool has_softcap, int64_t num_splits,
    std::optional<bool> pack_gqa_, int64_t sm_margin);

// The schema's entry: the wrapper's 37 arguments (mha_fwd's 36 plus only_qv, refused here), with
// sinks as a plain optional tensor (a schema cannot bind mha_fwd's `optional<const Tensor>&`).
static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_entry(
    at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> k_new, std::optional<at::Tensor> v_new,
    std::optional<at::Tensor> q_v, std::optional<at::Tensor> out, std::optional<at::Tensor> cu_seqlens_q,
    std::optional<at::Tensor> cu_seqlens_k, std::optional<at::Tensor> cu_seqlens_k_new,
    std::optional<at::Tensor> seqused_q, std::optional<at::Tensor> seqused_k, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_k, std::optional<at::Tensor> page_table, std::optional<at::Tensor> kv_batch_idx,
    std::optional<at::Tensor> leftpad_k, std::optional<at::Tensor> rotary_cos, std::optional<at::Tensor> rotary_sin,
    std::optional<at::Tensor> seqlens_rotary, std::optional<at::Tensor> q_descale, std::optional<at::Tensor> k_descale,
    std::optional<at::Tensor> v_descale, std::optional<double> softmax_scale, bool is_causal, int64_t wl, int64_t wr,
    int64_t attention_chunk, double softcap, bool is_rotary_interleaved, std::optional<at::Tensor> scheduler_metadata,
    int64_t num_splits, std::optional<bool> pack_gqa, int64_t sm_margin, std::optional<at::Tensor> sinks,
    std::optional<at::Tensor> sparse_mask_fine, bool only_qv) {
  TORCH_CHECK(!only_qv, "minimal FA3 build: only_qv=True (MLA rope-dim-0 path) is not supported");
  std::optional<const at::Tensor> sinks_c = sinks.has_value() ? std::optional<const at::Tensor>(*sinks) : std::nullopt;
  return mha_fwd(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
      seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
      seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, is_causal, wl, wr, attention_chunk, softcap,
      is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin, sinks_c, sparse_mask_fine);
}

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {
  // Argument order/names follow sgl_kernel 0.4.5 flash_attn.py (varlen path passes the tail by keyword:
  // is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin, sinks, sparse_mask_fine, only_qv).
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? k_new, Tensor? v_new, Tensor? q_v, Tensor(a!)? out,"
      " Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? seqused_k,"
      " int? max_seqlen_q, int? max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, Tensor? leftpad_k,"
      " Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, Tensor? q_descale, Tensor? k_descale,"
      " Tensor? v_descale, float? softmax_scale, bool is_causal, int window_size_left, int window_size_right,"
      " int attention_chunk, float softcap, bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_splits,"
      " bool? pack_gqa, int sm_margin, Tensor? sinks=None, Tensor? sparse_mask_fine=None, bool only_qv=False)"
      " -> (Tensor(a!), Tensor, Tensor, Tensor)");
  m.impl("fwd", torch::kCUDA, &fwd_entry);
  m.def(
      "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads, int num_heads_k,"
      " int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q,"
      " Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? leftpad_k, int? page_size,"
      " int max_seqlen_k_new=0, bool is_causal=False, int window_size_left=-1, int window_size_right=-1,"
      " int attention_chunk=0, bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, int sm_margin=0)"
      " -> Tensor");
  m.impl("get_scheduler_metadata", torch::kCUDA, &mha_fwd_get_scheduler_metadata);
}

#ifndef FLASH_OPS_NO_PYTHON
// `from sgl_kernel import flash_ops` needs a real Python module named flash_ops.
PyMODINIT_FUNC PyInit_flash_ops() {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flash_ops", nullptr, 0, nullptr};
  return PyModule_Create(&module);
}
#endif

