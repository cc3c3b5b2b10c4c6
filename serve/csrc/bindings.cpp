// The Python module of serve's CPU kernels: one extension built from every source in serve/csrc
// (serve/cpu_kernels.py), so a checkout compiles and loads it once.

#include <torch/extension.h>

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType out_dtype);
void gemv_bf16_out(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor out, bool round_bf16);
torch::Tensor gemv_f32(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType out_dtype);
torch::Tensor gemv_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros,
                        int64_t group, at::ScalarType out_dtype);
torch::Tensor gemv_int4_a8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros,
                           int64_t group, at::ScalarType out_dtype);
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, at::ScalarType out_dtype);
bool int8_rounds_activations(int64_t K);
torch::Tensor round_rows_int16(const torch::Tensor& x);
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& w, double eps);
int64_t parallel_threads();
bool amx_enable();
torch::Tensor amx_pack_bf16(const torch::Tensor& w);
void amx_linear_bf16_out(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         torch::Tensor out, bool round_bf16);
torch::Tensor amx_linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
void set_isa(const std::string& name);
std::string current_isa();
void set_row_order(const std::string& order);
std::string row_order();
torch::Tensor argmax_rows(const torch::Tensor& logits);
torch::Tensor screen_candidates(const torch::Tensor& approx, const torch::Tensor& scale, const torch::Tensor& scale_l1,
                                const torch::Tensor& a, const torch::Tensor& c, double step, double slack);
std::vector<torch::Tensor> screen_quantize(const torch::Tensor& x, int64_t Km, int64_t T);
void screen_pack(const torch::Tensor& q, const torch::Tensor& perm, torch::Tensor main, torch::Tensor tail_rows, torch::Tensor rowsum);
torch::Tensor screen_gemm_u8(const torch::Tensor& u, const torch::Tensor& w16, const torch::Tensor& params,
                             const torch::Tensor& main, const torch::Tensor& tail, const torch::Tensor& rowsum,
                             const torch::Tensor& scale, const torch::Tensor& scale_l1, const torch::Tensor& a,
                             const torch::Tensor& c, torch::Tensor out, torch::Tensor tile_hi, const torch::Tensor& tail8,
                             bool amx, double step, double slack, torch::Tensor written);
std::vector<torch::Tensor> screen_pairs(const torch::Tensor& approx, const torch::Tensor& scale, const torch::Tensor& scale_l1,
                                        const torch::Tensor& a, const torch::Tensor& c, const torch::Tensor& lohi,
                                        const torch::Tensor& tile_hi, double step, double slack, int64_t cap,
                                        const torch::Tensor& written);
void gemv_f32_pairs(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& rows, const torch::Tensor& cols,
                    torch::Tensor out);
void gemv_bf16_pairs(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& rows, const torch::Tensor& cols,
                     torch::Tensor out);
torch::Tensor gemm_bf16_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
torch::Tensor gated_act_bf16(const torch::Tensor& gate_up, bool gelu);
torch::Tensor rms_norm_bf16_scaled(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::vector<torch::Tensor> add_rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& y, const c10::optional<torch::Tensor>& w_y,
                                             const c10::optional<torch::Tensor>& w_x, double eps);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& ctx_lens, const torch::Tensor& q_starts,
                              const torch::Tensor& q_lens, int64_t block_size, double scale, int64_t window);
std::vector<torch::Tensor> rope_write_kv(const torch::Tensor& qk, const torch::Tensor& v, const torch::Tensor& cos,
                                         const torch::Tensor& sin, const torch::Tensor& slots, torch::Tensor k_cache,
                                         torch::Tensor v_cache, int64_t num_heads, const c10::optional<torch::Tensor>& qk_weight,
                                         double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16, "y = x @ w.T for a bf16 weight, float32 accumulation ");
  m.def("gemv_bf16_out", &gemv_bf16_out, "x @ w.T for a bf16 weight into a float32 out, rounded through bf16 if asked");
  m.def("gemv_f32", &gemv_f32, "y = x @ w.T for a float32 weight read in place ");
  m.def("gemv_int4", &gemv_int4, "y = x @ dequant(q).T for Warsha's int4 layout, float32 activations ");
  m.def("gemv_int4_a8", &gemv_int4_a8, "y = x @ dequant(q).T, activations quantized to int8 per 32 features ");
  m.def("gemv_int8", &gemv_int8, "y = (x @ q.T) * scale for an int8 weight with one scale per output row ");
  m.def("int8_rounds_activations", &int8_rounds_activations, "whether gemv_int8 rounds rows to int16 for this K here");
  m.def("round_rows_int16", &round_rows_int16, "rows rounded as gemv_int8 rounds them on 512-bit VNNI variants");
  m.def("rms_norm_bf16", &rms_norm_bf16, "transformers' RMSNorm on bf16 rows in one call");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on new queries/keys and their K/V written into the paged cache, in one call");
  m.def("set_isa", &set_isa, "run the named ISA variant of the matrix products (avx2, avx512, avx512_vnni, avx512_bf16, amx)");
  m.def("amx_enable", &amx_enable, "ask the OS for the AMX tile state once; false where the CPU or OS gives none");
  m.def("amx_pack_bf16", &amx_pack_bf16, "a bf16 weight [N, K] in AMX tile order (N % 16 == 0, K % 32 == 0)");
  m.def("amx_linear_bf16_out", &amx_linear_bf16_out, "out = x @ W.T (+ bias) on AMX tiles, into a bf16 or float32 out");
  m.def("amx_linear_bf16", &amx_linear_bf16, "x @ W.T (+ bias) on AMX tiles, bf16 out, one rounding");
  m.def("current_isa", &current_isa, "the ISA variant the matrix products run");
  m.def("set_row_order", &set_row_order, "one-row products: 'stream' (row after row) or 'interleave' (row groups); '' = the CPU's default");
  m.def("row_order", &row_order, "how one-row products walk the weights: 'stream' or 'interleave'");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for ran on (1 without OpenMP)");
  m.def("rms_norm_bf16_scaled", &rms_norm_bf16_scaled, "RMSNorm of bf16 rows times a float32 weight, rounded once (Gemma's 1 + w)");
  m.def("gemm_bf16_rows", &gemm_bf16_rows, "x @ w.T (+ bias) for bf16 x and w of 5-96 rows, bf16 out, weights asked for ahead");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "x + norm(y) and the next norm of that sum, bf16 rows, in one pass");
  m.def("gated_act_bf16", &gated_act_bf16, "act(gate) * up of bf16 rows [T, 2I] holding gate then up; SiLU or tanh GELU");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (or first NaN), as torch.argmax(-1)");
  m.def("screen_candidates", &screen_candidates, "columns whose bounded logit can reach its row's best (serve/head_screen.py)");
  m.def("screen_pack", &screen_pack, "the head's int8 copy in the batch screen's packed layout, in one pass");
  m.def("screen_quantize", &screen_quantize, "rows as the batch head screen reads them: uint8 main channels, int16 tail");
  m.def("screen_gemm_u8", &screen_gemm_u8, "the batch head screen's int8 logits (vpdpbusd) and each row's best bounds");
  m.def("screen_pairs", &screen_pairs, "per row, the columns whose bounded logit can reach the row's best");
  m.def("gemv_f32_pairs", &gemv_f32_pairs, "x @ w.T at chosen (row, column) pairs, float32");
  m.def("gemv_bf16_pairs", &gemv_bf16_pairs, "x @ w.T at chosen (row, column) pairs, rounded through bf16");
  m.def("paged_attention", &paged_attention, "paged attention of short query chunks from the heads-first cache ");
}
