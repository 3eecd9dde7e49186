// Routing all-gather and the routed-row schedule (docs/ARCHITECTURE.md), built on the device with
// prefix sums: no host sync, and the row order is a pure function of the routing.
//
// Row order inside local expert e: (source rank, source token) ascending. The tokens of every
// source rank are cut into chunks of kChunk tokens; the position of a routed pair is
//   expert_offsets[e] + (rows of e in all earlier (rank, chunk) blocks)
//                     + (tokens before it in its chunk that also chose e),
// the first from a count pass + scan, the second from a per-chunk bitmask and popcounts.
#include "barrier.cuh"

namespace mok {
namespace {

constexpr int kChunk = 256;         // tokens per block in the count and fill passes
constexpr int kMaxExperts = 8192;   // smem histogram bound of the count pass
constexpr int kMaxLocalExperts = 1024;  // smem bitmask bound of the fill pass (32 KB)

// Ids are saturated to [-1, num_experts] before narrowing (as the reference does), so an invalid id
// stays invalid (2**32 never wraps to 0) and the gathered routing has the reference's bits.
// The last block to finish runs the barrier that completes the all-gather (and flips the double
// buffer); every block read the half before any block can arrive, so the flip is safe.
__global__ void gather_routing_kernel(const void* top_experts, int is_int64, int n, PeerPtrs bufs, int* state,
                                      int* errors, PeerPtrs flags, uint64_t timeout_ns, int* zero_buf, int n_zero,
                                      int rank, int ep, int num_experts) {
  const int half = state[kStateGatherCount] & 1;
  const int64_t off = (static_cast<int64_t>(half) * ep + rank) * n;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const long long w = is_int64 ? static_cast<const long long*>(top_experts)[i]
                                 : static_cast<long long>(static_cast<const int*>(top_experts)[i]);
    const int v = static_cast<int>(w < -1 ? -1 : (w > num_experts ? num_experts : w));
    for (int q = 0; q < ep; ++q) static_cast<int*>(bufs.p[q])[off + i] = v;
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_zero; i += gridDim.x * blockDim.x) zero_buf[i] = 0;
  if (last_block_arrive(state + kStateArrive))
    barrier_block(flags, state, errors, rank, ep, timeout_ns, /*bump_gather=*/1);
}

// The scan of the count pass, run by its last block: per-expert scan over (rank, chunk) blocks,
// padded offsets, overflow check of every rank (so all ranks raise the same error). s_off: nle + 1
// ints of shared memory. Other blocks' writes are read with .cg loads (never through L1).
__device__ void scan_block(int* chunk_counts, const int* expert_rows_all, int* errors, int* expert_counts,
                           int* expert_offsets, int ep, int nle, int nchunks, int capacity, int* s_off) {
  const int J = ep * nchunks;
  for (int e = threadIdx.x; e < nle; e += blockDim.x) {
    int* row = chunk_counts + static_cast<int64_t>(e) * J;
    int run = 0;
    for (int j = 0; j < J; ++j) {
      const int v = __ldcg(row + j);
      row[j] = run;
      run += v;
    }
    expert_counts[e] = run;
    s_off[e] = (run + kRowAlign - 1) / kRowAlign * kRowAlign;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < nle; ++e) {
      const int v = s_off[e];
      s_off[e] = run;
      run += v;
    }
    s_off[nle] = run;
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= nle; e += blockDim.x) expert_offsets[e] = min(s_off[e], capacity);
  for (int e = threadIdx.x; e < nle; e += blockDim.x) {
    int* row = chunk_counts + static_cast<int64_t>(e) * J;
    for (int j = 0; j < J; ++j) row[j] += s_off[e];
  }
  // Padded rows of every rank (the reference flags the largest one that exceeds the capacity).
  for (int q = threadIdx.x; q < ep; q += blockDim.x) {
    int rows = 0;
    for (int e = 0; e < nle; ++e)
      rows += (__ldcg(expert_rows_all + q * nle + e) + kRowAlign - 1) / kRowAlign * kRowAlign;
    if (rows > capacity) flag_max(errors + kErrCapacityOverflow, rows);
  }
}

// Pass 1, one block per (chunk, source rank): copies the gathered routing into top_all, checks it,
// counts the rows of every local expert in the chunk, and adds every expert's rows to the global
// histogram (integer atomics: the result does not depend on their order); fills the row arrays
// with -1 (pass 3 writes the real rows). The last block to finish runs the scan (pass 2).
__global__ void count_kernel(const int* routing_buf, int* state, int* errors, int* top_all, int* chunk_counts,
                             int* expert_rows_all, int* row_src_rank, int* row_src_slot, int* expert_counts,
                             int* expert_offsets, int rank, int ep, int T, int k, int nle, int num_experts,
                             int nchunks, int capacity) {
  extern __shared__ int s_hist[];  // [max(num_experts, nle + 1)]
  {
    const int nthreads = gridDim.x * gridDim.y * blockDim.x;
    for (int i = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; i < capacity; i += nthreads) {
      row_src_rank[i] = -1;
      row_src_slot[i] = -1;
    }
  }
  for (int g = threadIdx.x; g < num_experts; g += blockDim.x) s_hist[g] = 0;
  __syncthreads();
  const int c = blockIdx.x, r = blockIdx.y;
  const int t = c * kChunk + threadIdx.x;
  const int half = state[kStateGatherParity];
  const int* src = routing_buf + (static_cast<int64_t>(half) * ep + r) * T * k;
  int* dst = top_all + static_cast<int64_t>(r) * T * k;
  if (t < T) {
    for (int s = 0; s < k; ++s) {
      const int g = src[t * k + s];
      dst[t * k + s] = g;
      for (int s2 = 0; s2 < s; ++s2)
        if (src[t * k + s2] == g) flag_max(errors + kErrDuplicateExpert, t + 1);
      if (g < 0 || g >= num_experts) {
        flag_max(errors + kErrExpertIdOutOfRange, t + 1);
      } else {
        atomicAdd(&s_hist[g], 1);
      }
    }
  }
  __syncthreads();
  const int lo = rank * nle;
  const int J = ep * nchunks;
  for (int e = threadIdx.x; e < nle; e += blockDim.x) chunk_counts[static_cast<int64_t>(e) * J + r * nchunks + c] = s_hist[lo + e];
  for (int g = threadIdx.x; g < num_experts; g += blockDim.x)
    if (s_hist[g]) atomicAdd(expert_rows_all + g, s_hist[g]);
  if (last_block_arrive(state + kStateArrive))
    scan_block(chunk_counts, expert_rows_all, errors, expert_counts, expert_offsets, ep, nle, nchunks, capacity,
               s_hist);
}

// Pass 3, one block per (chunk, source rank): rank of each pair among the chunk's tokens that
// chose the same expert, from a bitmask of those tokens; writes the pair into its row.
__global__ void fill_kernel(const int* top_all, const int* chunk_base, int* row_src_rank, int* row_src_slot, int rank,
                            int ep, int T, int k, int nle, int nchunks, int capacity) {
  extern __shared__ uint32_t s_mask[];  // [nle][kChunk / 32]
  constexpr int W = kChunk / 32;
  for (int i = threadIdx.x; i < nle * W; i += blockDim.x) s_mask[i] = 0;
  __syncthreads();
  const int c = blockIdx.x, r = blockIdx.y;
  const int t = c * kChunk + threadIdx.x;
  const int* row = top_all + (static_cast<int64_t>(r) * T + t) * k;
  const int lo = rank * nle;
  const int w = threadIdx.x / 32;
  const uint32_t bit = 1u << (threadIdx.x % 32);
  if (t < T) {
    for (int s = 0; s < k; ++s) {
      const int e = row[s] - lo;
      if (e >= 0 && e < nle) atomicOr(&s_mask[e * W + w], bit);
    }
  }
  __syncthreads();
  if (t < T) {
    const int J = ep * nchunks;
    for (int s = 0; s < k; ++s) {
      const int e = row[s] - lo;
      if (e < 0 || e >= nle) continue;
      int before = __popc(s_mask[e * W + w] & (bit - 1));
      for (int ww = 0; ww < w; ++ww) before += __popc(s_mask[e * W + ww]);
      const int pos = chunk_base[static_cast<int64_t>(e) * J + r * nchunks + c] + before;
      if (pos < capacity) {  // beyond: overflow, flagged by the scan; never written out of bounds
        row_src_rank[pos] = r;
        row_src_slot[pos] = t * k + s;
      }
    }
  }
}

}  // namespace

const char* launch_gather_routing(const void* top_experts, bool is_int64, int n, const PeerPtrs& bufs,
                                  int* state, int* errors, const PeerPtrs& flags, uint64_t timeout_ns,
                                  int* zero_buf, int n_zero, int rank, int ep, int num_experts,
                                  cudaStream_t stream) {
  if (ep < 1 || ep > kMaxPeers || rank < 0 || rank >= ep) return "mok gather_routing: bad rank / EP size";
  // n == 0 still runs one block: the barrier (and the double-buffer flip) must happen on every rank
  const int blocks = max(1, min((max(n, n_zero) + 255) / 256, 1024));
  gather_routing_kernel<<<blocks, 256, 0, stream>>>(top_experts, is_int64 ? 1 : 0, n, bufs, state, errors, flags,
                                                     timeout_ns, zero_buf, n_zero, rank, ep, num_experts);
  return launch_status();
}

int64_t schedule_histogram_offset(int ep, int T, int nle) {
  const int nchunks = (T + kChunk - 1) / kChunk;
  return static_cast<int64_t>(nle) * ep * nchunks;
}

int64_t schedule_scratch_ints(int ep, int T, int nle, int num_experts) {
  return schedule_histogram_offset(ep, T, nle) + num_experts;
}

const char* launch_schedule(const int* routing_buf, int* state, int* errors, int* top_all, int* row_src_rank,
                            int* row_src_slot, int* expert_counts, int* expert_offsets, int* scratch, int rank,
                            int ep, int T, int k, int nle, int num_experts, int capacity, cudaStream_t stream) {
  if (num_experts > kMaxExperts) return "mok schedule: more than 8192 experts";
  if (nle > kMaxLocalExperts) return "mok schedule: more than 1024 local experts";
  if (nle * ep != num_experts) return "mok schedule: num_experts != nle * ep";
  if (T <= 0 || k <= 0 || capacity % kRowAlign) return "mok schedule: bad T / k / capacity";
  const int nchunks = (T + kChunk - 1) / kChunk;
  int* chunk_counts = scratch;
  // zeroed by the gather launch (launch_gather_routing's zero_buf)
  int* expert_rows_all = scratch + schedule_histogram_offset(ep, T, nle);
  dim3 grid(nchunks, ep);
  const size_t smem = sizeof(int) * max(num_experts, nle + 1);
  count_kernel<<<grid, kChunk, smem, stream>>>(routing_buf, state, errors, top_all, chunk_counts, expert_rows_all,
                                               row_src_rank, row_src_slot, expert_counts, expert_offsets, rank, ep, T,
                                               k, nle, num_experts, nchunks, capacity);
  if (const char* m = launch_status()) return m;
  fill_kernel<<<grid, kChunk, sizeof(uint32_t) * nle * (kChunk / 32), stream>>>(
      top_all, chunk_counts, row_src_rank, row_src_slot, rank, ep, T, k, nle, nchunks, capacity);
  return launch_status();
}

}  // namespace mok
