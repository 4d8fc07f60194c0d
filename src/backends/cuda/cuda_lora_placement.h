// Adapter placement on CUDA (CudaBackend::begin_lora_placement; the protocol is LoraPlacement's in
// ops/backend.h): the slot pool's worker copies an adapter's factors to the device and writes its
// slot's table entries on a copy stream of their own, while the engine thread runs steps on the
// main stream.
//
// - Host to device through two pinned staging chunks (double-buffered, 16 MiB each): a factor is
//   converted to bf16 if it is not already (the registry converts at load, so usually a memcpy)
//   into one chunk while the other one's copies run; the worker waits on a chunk's event before
//   refilling it. At most two chunks are in flight, so a device-wide synchronisation on the engine
//   thread (cudaFree in CudaBackend::fit_scratch, say) waits for 32 MiB of copies, not an adapter.
// - Device memory: one block per placement from a stream-ordered memory pool
//   (cudaMallocFromPoolAsync / cudaFreeAsync on the copy stream), not cudaMalloc/cudaFree:
//   cudaFree synchronises the whole device and cudaMalloc may, so either on the worker would stall
//   the step in flight. Not memory reserved per slot at start-up either: the engine's memory plan
//   already keeps max_loras_per_batch x adapter_slot_bytes(max_lora_rank) out of the KV cache
//   (runtime/memory_plan.h), and the pool grows into that headroom, but a per-slot reservation at
//   max_lora_rank on every target would hold all of it whatever the adapters' ranks (Qwen3-30B-A3B
//   at rank 128: 10 GiB per slot). Blocks freed go back to the pool (release threshold: never
//   trimmed), so later placements reuse them without asking the driver again. A pool that cannot
//   grow fails only that placement (ResourceExhausted), never the process.
// - Frees are stream-ordered after the main stream's work queued so far (an event recorded on the
//   main stream, waited for by the copy stream): a slot is freed on the engine thread between
//   steps, and no later step references it.
// - Readiness: finish() records an event after the last copy and entry write and waits for it on
//   the worker (a blocking-sync event: no spinning core); ready() queries it; commit() makes the
//   main stream wait for it (the allocation's stream order) and only then updates the host rank
//   mirrors and the rank ceiling of captured graphs (which may drop them), on the engine thread.
#pragma once

#include <cuda_runtime.h>

#include <mutex>

namespace moelora::cuda {

// Shared by a CudaBackend and its placements (a placement may outlive the backend: the slot pool
// of a tool can be destroyed after it), created on the first placement.
class LoraCopier {
 public:
  explicit LoraCopier(cudaStream_t main);
  ~LoraCopier();
  LoraCopier(const LoraCopier&) = delete;
  LoraCopier& operator=(const LoraCopier&) = delete;

  // The backend is going away: frees no longer wait for its main stream (it was synchronised).
  void detach_main();

  cudaStream_t stream() const { return copy_; }
  cudaMemPool_t pool() const { return pool_; }
  int device() const { return device_; }
  // Worker side: one placement's copies at a time (the staging chunks are shared).
  std::mutex& mutex() { return mu_; }
  // Queues a copy of `bytes` device bytes to `dst` through the staging chunks. With `from_f32`,
  // `src` holds bytes / 2 floats, rounded to bf16 on the way; else `bytes` raw bytes.
  void copy_to_device(void* dst, const void* src, size_t bytes, bool from_f32);
  // Engine thread (or the thread destroying a slot pool): frees `block` after the work the main
  // stream has queued so far.
  void free_after_main(void* block);

 private:
  void next_chunk();

  static constexpr size_t kChunkBytes = 16u << 20;
  static constexpr int kChunks = 2;
  int device_ = 0;
  cudaStream_t copy_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
  struct Chunk {
    char* host = nullptr;
    cudaEvent_t done = nullptr;  // recorded after the last copy out of it
  };
  Chunk chunks_[kChunks];
  int cur_ = 0;
  size_t fill_ = 0;
  std::mutex mu_;
  std::mutex main_mu_;
  cudaStream_t main_ = nullptr;
  cudaEvent_t release_ = nullptr;
};

}  // namespace moelora::cuda
