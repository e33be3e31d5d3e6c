// Rows of a packed batch's outputs that no kernel writes: those before the
// first sequence and after the last, and, with seqused_k, each sequence's keys
// past its count (their gradients). The CUDA ops allocate outputs without
// initialising them and clear these rows on the device, reading the offsets
// there as the kernels do (params.h SeqLens, clamped), never on the host.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "params.h"

namespace tfb {

struct PackedRows {
  SeqLens seqlens;  // cu_q and total_q for query rows; cu_k, used_k and total_k for keys
  bool keys;        // clear key rows (else query rows)
  int batch;
  int max_len;      // the longest sequence the caller named (max_q / max_k): kernels write no further
  // Up to three tensors of rows (total, row_bytes) contiguous: set to 0.
  void* rows[3] = {nullptr, nullptr, nullptr};
  int64_t row_bytes = 0;
  // Query rows: lse (heads, total_q) float32, set to -inf there.
  float* lse = nullptr;
  int heads = 0;
};

cudaError_t clear_unwritten_rows(const PackedRows& p, cudaStream_t stream);

}  // namespace tfb
