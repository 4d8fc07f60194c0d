// Every CUDA and cuBLAS call is checked; a failure is a broken invariant (abort with file:line).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/check.h"

#define MOELORA_CUDA_CHECK(call)                                                          \
  do {                                                                                    \
    cudaError_t _e = (call);                                                              \
    MOELORA_CHECK_MSG(_e == cudaSuccess, "{} failed: {}", #call, cudaGetErrorString(_e)); \
  } while (0)

// After a kernel launch: catches launch-configuration errors immediately.
#define MOELORA_CUDA_CHECK_LAUNCH() MOELORA_CUDA_CHECK(cudaGetLastError())

#define MOELORA_CUBLAS_CHECK(call)                                                         \
  do {                                                                                     \
    cublasStatus_t _s = (call);                                                            \
    MOELORA_CHECK_MSG(_s == CUBLAS_STATUS_SUCCESS, "{} failed: status {}", #call, static_cast<int>(_s)); \
  } while (0)
