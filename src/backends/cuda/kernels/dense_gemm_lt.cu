// cuBLASLt paths of the dense projection (see dense_gemm.cuh): the FP8 block-scaled GEMM and the
// bf16 GEMM used for prefill-sized M. Recipe (checked on the H200, docs/gpu.md): compute
// D^T = W X^T in column-major terms, TRANSA = T, TRANSB = N; the weight [N, K] is operand A with
// BLK128x128 f32 scales (the checkpoint's scale_inv as it is), the quantised activations [M, K]
// are operand B with VEC128 f32 scales stored [K/128][M], token fastest.
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels/dense_gemm.cuh"

namespace moelora::cuda {
namespace {

int64_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && v % static_cast<uintptr_t>(a) != 0) a >>= 1;
  return a;
}

// Owns the descriptors of one GEMM (host objects; creating them is cheap and capture-safe).
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
  // Column-major D[n, M] = op(A)[n, K] * B[K, M] with A stored K x n (a row-major [n, K] weight).
  void init(cudaDataType_t ab_type, cudaDataType_t d_type, int n, int M, int K, int64_t ldb, int64_t ldd) {
    MOELORA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    MOELORA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    MOELORA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    MOELORA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, ab_type, K, n, K));
    MOELORA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, ab_type, K, M, ldb));
    MOELORA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d, d_type, n, M, ldd));
  }
};

}  // namespace

DenseGemmContext::DenseGemmContext(size_t lt_workspace_bytes) {
  MOELORA_CUBLAS_CHECK(cublasLtCreate(&lt_));
  workspace_bytes_ = lt_workspace_bytes;
  if (workspace_bytes_ > 0) MOELORA_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

DenseGemmContext::~DenseGemmContext() {
  if (workspace_) cudaFree(workspace_);
  if (lt_) cublasLtDestroy(lt_);
}

DenseGemmContext::Algo& DenseGemmContext::algo_for(const Key& key, cublasLtMatmulDesc_t op,
                                                         cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                                                         cublasLtMatrixLayout_t ld) {
  auto it = algos_.find(key);
  if (it != algos_.end()) return it->second;
  Algo algo;
  cublasLtMatmulPreference_t pref;
  MOELORA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  MOELORA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // The heuristic assumes 256-byte aligned operands unless told otherwise.
  const uint32_t al_a = static_cast<uint32_t>(key[7] & 0xffff), al_b = static_cast<uint32_t>((key[7] >> 16) & 0xffff),
                 al_d = static_cast<uint32_t>((key[7] >> 32) & 0xffff);
  MOELORA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  MOELORA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  MOELORA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d)));
  MOELORA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, op, la, lb, ld, ld, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  algo.ok = st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS;
  if (algo.ok) algo.algo = res.algo;
  return algos_.emplace(key, algo).first->second;
}

bool DenseGemmContext::launch(Algo& algo, cublasLtMatmulDesc_t op, const void* A, cublasLtMatrixLayout_t la,
                              const void* B, cublasLtMatrixLayout_t lb, void* D, cublasLtMatrixLayout_t ld,
                              cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  // cuBLASLt validates before it launches: a refusal here (seen once on the H200 for a split FP8
  // weight the heuristic had accepted) launches nothing, so the caller can fall back. The shape
  // is remembered as unsupported.
  const cublasStatus_t st = cublasLtMatmul(lt_, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &algo.algo, workspace_,
                                           workspace_bytes_, stream);
  if (st != CUBLAS_STATUS_SUCCESS) algo.ok = false;
  return st == CUBLAS_STATUS_SUCCESS;
}

bool DenseGemmContext::gemm_fp8(const DenseArgs& a, const uint8_t* xq, int64_t ld_q, const float* x_scales,
                                cudaStream_t stream) {
  const DenseWeight& w = a.w;
  if (w.type != WeightType::kFP8E4M3 || w.block_out != 128 || w.block_in != 128) return false;
  const int K = w.in, scale_cols = (K + 127) / 128;
  // A split that is not on a 128-row boundary restarts the scale rows: run the halves separately
  // so that each is a standard BLK128x128 operand.
  struct Part {
    int n0, n, scale_row0;
  };
  std::vector<Part> parts;
  if (w.split_rows > 0 && w.split_rows % 128 != 0 && w.split_rows < w.out) {
    if (w.split_rows % 8 != 0 || scale_cols % 4 != 0) return false;  // the halves must start 16-byte aligned
    parts.push_back({0, w.split_rows, 0});
    parts.push_back({w.split_rows, w.out - w.split_rows, (w.split_rows + 127) / 128});
  } else {
    parts.push_back({0, w.out, 0});
  }
  const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  std::vector<LtGemm> g(parts.size());
  std::vector<Key> keys(parts.size());
  const bool f32_out = a.y_f32 != nullptr;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& pt = parts[i];
    g[i].init(CUDA_R_8F_E4M3, f32_out ? CUDA_R_32F : CUDA_R_16BF, pt.n, a.M, K, ld_q, a.ld_y);
    const void* sa = w.scale_inv + static_cast<int64_t>(pt.scale_row0) * scale_cols;
    MOELORA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g[i].op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
    MOELORA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g[i].op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
    MOELORA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g[i].op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    MOELORA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g[i].op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales, sizeof(x_scales)));
    const uint8_t* A = static_cast<const uint8_t*>(w.w) + static_cast<int64_t>(pt.n0) * K;
    const void* D = f32_out ? static_cast<const void*>(a.y_f32 + pt.n0) : static_cast<const void*>(a.y + pt.n0);
    keys[i] = Key{0, f32_out, a.M, pt.n, K, ld_q, a.ld_y,
                  alignment_of(A) | (alignment_of(xq) << 16) | (alignment_of(D) << 32), 0, 0};
  }
  // Decide every part before launching any, so that a refusal launches nothing.
  std::vector<Algo*> algos(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    algos[i] = &algo_for(keys[i], g[i].op, g[i].a, g[i].b, g[i].d);
    if (!algos[i]->ok) return false;
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& pt = parts[i];
    const uint8_t* A = static_cast<const uint8_t*>(w.w) + static_cast<int64_t>(pt.n0) * K;
    void* D = f32_out ? static_cast<void*>(a.y_f32 + pt.n0) : static_cast<void*>(a.y + pt.n0);
    // A refusal of the second half after the first ran leaves y partly written: the caller's
    // fallback recomputes all of it.
    if (!launch(*algos[i], g[i].op, A, g[i].a, xq, g[i].b, D, g[i].d, stream)) return false;
  }
  return true;
}

bool DenseGemmContext::gemm_bf16(const DenseArgs& a, cudaStream_t stream) {
  const DenseWeight& w = a.w;
  if (w.type != WeightType::kBF16) return false;
  const bool f32_out = a.y_f32 != nullptr;
  LtGemm g;
  g.init(CUDA_R_16BF, f32_out ? CUDA_R_32F : CUDA_R_16BF, w.out, a.M, w.in, a.ld_x, a.ld_y);
  void* D = f32_out ? static_cast<void*>(a.y_f32) : static_cast<void*>(a.y);
  const Key key{1, f32_out, a.M, w.out, w.in, a.ld_x, a.ld_y,
                alignment_of(w.w) | (alignment_of(a.x) << 16) | (alignment_of(D) << 32), 0, 0};
  Algo& algo = algo_for(key, g.op, g.a, g.b, g.d);
  if (!algo.ok) return false;
  return launch(algo, g.op, w.w, g.a, a.x, g.b, D, g.d, stream);
}

}  // namespace moelora::cuda
