// Row scatter-add of the embedding backward: grad[row] += src[t] for every token t whose id is
// `row`. One block per distinct id (so no two blocks touch one row: no atomics), each thread a
// strided set of columns, adding that id's tokens in ascending token order -- the order of a
// sequential scatter-add, so every sum rounds as candle's (CPU or CUDA) `scatter_add` does.
// Compiled at run time with NVRTC after common.cuh, no CUDA headers.
//
// csr = [order (k) | seg (n_rows + 1) | rows (n_rows)]: the token positions sorted by id (stable),
// where each id's positions start, and the ids; built on the host from the batch's ids.
__device__ __forceinline__ float widen(unsigned short x) { return bf2f(x); }
__device__ __forceinline__ float widen(float x) { return x; }

template <typename T>
__device__ void rows_add(const T* __restrict__ src, float* __restrict__ grad, const unsigned* __restrict__ csr, int k,
                         int n_rows, int h) {
    const unsigned* order = csr;
    const unsigned* seg = csr + k;
    const unsigned* rows = csr + k + n_rows + 1;
    const int u = blockIdx.x;
    const long long row = rows[u];
    const unsigned a = seg[u], b = seg[u + 1];
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = grad[row * h + j];
        for (unsigned i = a; i < b; i++) acc += widen(src[(long long)order[i] * h + j]);
        grad[row * h + j] = acc;
    }
}

extern "C" __global__ void mt_rows_add_bf16(const unsigned short* __restrict__ src, float* __restrict__ grad,
                                            const unsigned* __restrict__ csr, int k, int n_rows, int h) {
    rows_add(src, grad, csr, k, n_rows, h);
}

extern "C" __global__ void mt_rows_add_f32(const float* __restrict__ src, float* __restrict__ grad,
                                           const unsigned* __restrict__ csr, int k, int n_rows, int h) {
    rows_add(src, grad, csr, k, n_rows, h);
}
