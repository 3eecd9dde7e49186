// wgmma m64 nN k16 (bf16 in, fp32 accumulate, both operands K-major from shared memory) for any N
// that is a multiple of 16, through CuTe's SM90 GMMA atoms, on accumulators acc[kOff, kOff + N / 2).
//
// One kernel must not mix an accumulator tuple of 128 registers (N = 256) with tuples that start
// inside it: ptxas then serializes every wgmma of the kernel (C7511). The kernels that mix tile
// shapes therefore issue N > 128 as two wgmmas, into acc[0, 64) and acc[64, ...).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <utility>

namespace mok {

// wgmma m64 nN k16 through CuTe's SM90 atoms, on the first N / 2 accumulators.
template <int N>
struct Atom;
#define MOK_XGEMM_ATOM(N) \
  template <>             \
  struct Atom<N> {        \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>; \
  };
MOK_XGEMM_ATOM(16)
MOK_XGEMM_ATOM(32)
MOK_XGEMM_ATOM(48)
MOK_XGEMM_ATOM(64)
MOK_XGEMM_ATOM(80)
MOK_XGEMM_ATOM(96)
MOK_XGEMM_ATOM(112)
MOK_XGEMM_ATOM(128)
MOK_XGEMM_ATOM(144)
MOK_XGEMM_ATOM(160)
MOK_XGEMM_ATOM(176)
MOK_XGEMM_ATOM(192)
MOK_XGEMM_ATOM(208)
MOK_XGEMM_ATOM(224)
MOK_XGEMM_ATOM(240)
MOK_XGEMM_ATOM(256)
#undef MOK_XGEMM_ATOM

template <int N, int kOff, size_t... Is>
__device__ __forceinline__ void wgmma_n(float (&d)[128], uint64_t da, uint64_t db, bool accumulate,
                                        std::index_sequence<Is...>) {
  Atom<N>::type::fma(da, db, d[kOff + Is]...,
                     accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

}  // namespace mok
