// Workbench timing (docs/floors.md says what the ceilings and floors mean): CUDA-graph replay of
// the measured launch(es), inputs rotated among several copies so that each replay reads from HBM
// (the H200's L2 is 60 MB), median of repeats, and ceilings measured in the same run (gpukit/timing.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>

namespace moelora::gpukit {

// How many input copies defeat the L2 for a working set of `bytes` (at least 2, ~200 MB total).
int rotation_copies(size_t bytes);

// Times `launch(stream, copy_index)` captured in a CUDA graph that replays every copy once;
// returns the median time per launch in microseconds over `reps` graph replays.
double time_graph_us(const std::function<void(cudaStream_t, int)>& launch, int copies, int reps = 20);

// Device-to-device copy bandwidth through cudaMemcpyAsync (a graph memcpy node): bytes read +
// written per second, in GB/s, on `bytes` per copy.
double measure_copy_gbps(size_t bytes = size_t(1) << 30);

// The same through a kernel (16-byte loads / stores, 4 blocks of 512 per SM): the DMA engine
// behind cudaMemcpyAsync moves less on this machine, so kernels are judged against this.
double measure_copy_kernel_gbps(size_t bytes = size_t(1) << 30);

// Time of one graph node that does nothing: the per-launch floor under graph replay, to read the
// small-kernel figures against.
double measure_empty_node_us();

// Prints the device and the copy ceilings measured now; returns the larger, in GB/s.
double print_ceilings(const char* bench);

}  // namespace moelora::gpukit
