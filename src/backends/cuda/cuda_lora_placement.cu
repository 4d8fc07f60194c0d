// CudaBackend, part 4: placing an adapter in a slot off the engine thread (cuda_lora_placement.h
// says how; ops/backend.h, LoraPlacement, which thread calls what and why it is safe).
#include "backends/cuda/cuda_lora_placement.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_check.h"
#include "core/dtype.h"

namespace moelora {

namespace cuda {

LoraCopier::LoraCopier(cudaStream_t main) : main_(main) {
  MOELORA_CUDA_CHECK(cudaGetDevice(&device_));
  MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device_;
  MOELORA_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
  uint64_t keep = UINT64_MAX;  // never trim at synchronisations: freed blocks serve later placements
  MOELORA_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
  for (Chunk& c : chunks_) {
    MOELORA_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&c.host), kChunkBytes, cudaHostAllocDefault));
    // Blocking sync: the worker sleeps while a chunk drains instead of spinning a core.
    MOELORA_CUDA_CHECK(cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming | cudaEventBlockingSync));
  }
  MOELORA_CUDA_CHECK(cudaEventCreateWithFlags(&release_, cudaEventDisableTiming));
}

LoraCopier::~LoraCopier() {
  if (copy_) cudaStreamSynchronize(copy_);
  for (Chunk& c : chunks_) {
    if (c.host) cudaFreeHost(c.host);
    if (c.done) cudaEventDestroy(c.done);
  }
  if (release_) cudaEventDestroy(release_);
  if (pool_) cudaMemPoolDestroy(pool_);  // deferred by the driver until its blocks are freed
  if (copy_) cudaStreamDestroy(copy_);
}

void LoraCopier::detach_main() {
  std::lock_guard<std::mutex> lk(main_mu_);
  main_ = nullptr;
}

void LoraCopier::next_chunk() {
  MOELORA_CUDA_CHECK(cudaEventRecord(chunks_[cur_].done, copy_));
  cur_ = (cur_ + 1) % kChunks;
  // The copies out of the chunk we are about to refill were queued a chunk ago; usually done.
  MOELORA_CUDA_CHECK(cudaEventSynchronize(chunks_[cur_].done));
  fill_ = 0;
}

void LoraCopier::copy_to_device(void* dst, const void* src, size_t bytes, bool from_f32) {
  size_t done = 0;
  while (done < bytes) {
    fill_ = (fill_ + 7) & ~size_t{7};
    if (fill_ >= kChunkBytes) next_chunk();
    const size_t n = std::min(bytes - done, kChunkBytes - fill_);  // even: bytes, chunk and fill_ are
    char* stage = chunks_[cur_].host + fill_;
    if (from_f32) {
      const float* s = static_cast<const float*>(src) + done / 2;
      auto* d = reinterpret_cast<uint16_t*>(stage);
      for (size_t i = 0; i < n / 2; ++i) d[i] = f32_to_bf16(s[i]);
    } else {
      std::memcpy(stage, static_cast<const char*>(src) + done, n);
    }
    MOELORA_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + done, stage, n, cudaMemcpyHostToDevice, copy_));
    fill_ += n;
    done += n;
  }
}

void LoraCopier::free_after_main(void* block) {
  std::lock_guard<std::mutex> lk(main_mu_);
  if (main_) {
    // Called between steps (never inside a capture): the main stream's queued work is the last
    // that could have read the block.
    MOELORA_CUDA_CHECK(cudaEventRecord(release_, main_));
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(copy_, release_, 0));
  }
  MOELORA_CUDA_CHECK(cudaFreeAsync(block, copy_));
}

}  // namespace cuda

// Friend of CudaBackend (commit updates its rank ceiling and waits on its main stream).
class CudaLoraPlacement final : public LoraPlacement {
 public:
  CudaLoraPlacement(CudaBackend& backend, std::shared_ptr<cuda::LoraCopier> copier, int slot, size_t bytes)
      : backend_(backend), copier_(std::move(copier)), slot_(slot), bytes_(bytes) {
    MOELORA_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming | cudaEventBlockingSync));
  }
  // Engine thread, between steps (LoraSlotPool destroys placements only there).
  ~CudaLoraPlacement() override {
    if (block_) copier_->free_after_main(block_);
    if (done_) cudaEventDestroy(done_);
  }

  Result<Tensor> upload(const Tensor& host) override {
    if (!status_.ok()) return status_;
    if (host.device() != Device::kCpu || !host.contiguous() ||
        (host.dtype() != DType::kBF16 && host.dtype() != DType::kF32))
      return fail(make_error(ErrorCode::kInternal, "adapter factor {} {}: expected a contiguous host f32 or bf16 tensor",
                             dtype_name(host.dtype()), host.shape_string()));
    std::lock_guard<std::mutex> lk(copier_->mutex());
    MOELORA_CUDA_CHECK(cudaSetDevice(copier_->device()));
    if (!block_) {
      const cudaError_t e = cudaMallocFromPoolAsync(&block_, std::max<size_t>(bytes_, 256), copier_->pool(),
                                                    copier_->stream());
      if (e != cudaSuccess) {
        block_ = nullptr;
        (void)cudaGetLastError();  // not sticky; clear it for this thread's next check
        size_t free = 0, total = 0;
        (void)cudaMemGetInfo(&free, &total);
        return fail(make_error(ErrorCode::kResourceExhausted,
                               "out of device memory: the adapter needs {:.2f} GiB, {:.2f} GiB of the device are free "
                               "({})",
                               gib(bytes_), gib(free), cudaGetErrorString(e)));
      }
    }
    const size_t n = static_cast<size_t>(host.numel()) * 2;  // bf16 on the device
    const size_t span = backend_.upload_bytes(DType::kBF16, host.numel());
    if (used_ + span > bytes_)
      return fail(make_error(ErrorCode::kInternal, "adapter factors exceed the {} bytes planned for them", bytes_));
    char* dst = static_cast<char*>(block_) + used_;
    used_ += span;
    copier_->copy_to_device(dst, host.data(), n, host.dtype() == DType::kF32);
    return Tensor(dst, DType::kBF16, host.shape(), Device::kCuda);
  }

  void set_lora(LoraModuleTable& t, const Tensor& a, const Tensor& b, int rank) override {
    if (!status_.ok()) return;
    if (rank > backend_.max_lora_rank()) {
      (void)fail(make_error(ErrorCode::kInvalidArgument, "LoRA rank {} above the CUDA kernels' {}", rank,
                            backend_.max_lora_rank()));
      return;
    }
    std::lock_guard<std::mutex> lk(copier_->mutex());
    MOELORA_CUDA_CHECK(cudaSetDevice(copier_->device()));
    put<int64_t>(t.a_ptrs, addr(a, rank));
    put<int64_t>(t.b_ptrs, addr(b, rank));
    put<int32_t>(t.ranks, rank);
    dense_.push_back({&t, rank});
  }

  void set_moe_lora(MoeLoraTable& t, const Backend::MoeLoraSlot& s) override {
    if (!status_.ok()) return;
    if (std::max(s.gu_rank, s.d_rank) > backend_.max_lora_rank()) {
      (void)fail(make_error(ErrorCode::kInvalidArgument, "expert LoRA rank {} above the CUDA kernels' {}",
                            std::max(s.gu_rank, s.d_rank), backend_.max_lora_rank()));
      return;
    }
    std::lock_guard<std::mutex> lk(copier_->mutex());
    MOELORA_CUDA_CHECK(cudaSetDevice(copier_->device()));
    put<int64_t>(t.gu_a, addr(s.gu_a, s.gu_rank));
    put<int64_t>(t.gu_b, addr(s.gu_b, s.gu_rank));
    put<int64_t>(t.gu_a_expert_stride, s.gu_a_stride);
    put<int64_t>(t.gu_b_expert_stride, s.gu_b_stride);
    put<int64_t>(t.d_a, addr(s.d_a, s.d_rank));
    put<int64_t>(t.d_b, addr(s.d_b, s.d_rank));
    put<int64_t>(t.d_a_expert_stride, s.d_a_stride);
    put<int64_t>(t.d_b_expert_stride, s.d_b_stride);
    put<int32_t>(t.gu_rank, s.gu_rank);
    put<int32_t>(t.d_rank, s.d_rank);
    experts_.push_back({&t, s.gu_rank, s.d_rank});
  }

  Status finish() override {
    if (!status_.ok()) return status_;
    {
      std::lock_guard<std::mutex> lk(copier_->mutex());
      MOELORA_CUDA_CHECK(cudaSetDevice(copier_->device()));
      MOELORA_CUDA_CHECK(cudaEventRecord(done_, copier_->stream()));
    }
    recorded_ = true;
    MOELORA_CUDA_CHECK(cudaEventSynchronize(done_));  // the worker sleeps; the engine thread does not
    return {};
  }

  bool ready() override {
    if (!recorded_) return false;
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    MOELORA_CUDA_CHECK(e);
    return true;
  }

  void commit() override {
    // Already complete (ready()); this puts the pool allocation in the main stream's order, which
    // is what makes it legal for the main stream's kernels to read.
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(backend_.main_, done_, 0));
    for (const Dense& d : dense_) {
      d.table->host_rank[slot_] = d.rank;
      backend_.raise_rank_ceiling(d.rank);
    }
    for (const Experts& x : experts_) {
      x.table->host_gu_rank[slot_] = x.gu_rank;
      x.table->host_d_rank[slot_] = x.d_rank;
      backend_.raise_rank_ceiling(std::max(x.gu_rank, x.d_rank));
    }
  }

 private:
  static double gib(size_t b) { return static_cast<double>(b) / (1ull << 30); }
  static int64_t addr(const Tensor& t, int rank) { return rank ? reinterpret_cast<int64_t>(t.data()) : 0; }
  // One entry of this slot in a table: through the staging chunks, like the factors, so it is
  // written in the copy stream's order (before done_).
  template <typename T>
  void put(const Tensor& table, T v) {
    copier_->copy_to_device(static_cast<char*>(table.data()) + static_cast<size_t>(slot_) * sizeof(T), &v,
                            sizeof(T), false);
  }
  Status fail(Status s) {
    status_ = s;
    return s;
  }

  struct Dense {
    LoraModuleTable* table;
    int rank;
  };
  struct Experts {
    MoeLoraTable* table;
    int gu_rank, d_rank;
  };
  CudaBackend& backend_;
  std::shared_ptr<cuda::LoraCopier> copier_;
  const int slot_;
  const size_t bytes_;   // planned: the sum of upload_bytes over the factors
  void* block_ = nullptr;
  size_t used_ = 0;
  cudaEvent_t done_ = nullptr;
  bool recorded_ = false;
  Status status_;        // the first error; later calls do nothing
  std::vector<Dense> dense_;      // host mirrors, applied in commit()
  std::vector<Experts> experts_;
};

std::unique_ptr<LoraPlacement> CudaBackend::begin_lora_placement(int slot, size_t bytes) {
  // Created on the first placement (engine thread, between steps): backends that never place an
  // adapter (benchmarks, the op suite) pin no staging memory.
  if (!copier_) copier_ = std::make_shared<cuda::LoraCopier>(main_);
  return std::make_unique<CudaLoraPlacement>(*this, copier_, slot, bytes);
}

}  // namespace moelora
