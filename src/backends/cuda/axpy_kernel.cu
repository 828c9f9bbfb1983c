// The streaming worker's built-in compute role on CUDA: y[i] = a * x[i] + b.
//
// Compiled to PTX by scripts/regenerate-ptx.sh (rerun it after changing this
// file); the PTX is checked in (ptx/) and embedded in the library, so the
// build needs no nvcc, and no CUDA runtime is involved. The multiply and the
// add are rounded separately (no fused multiply-add), so every element is
// bit-identical to the host backend's plain loop and the worker can verify
// results exactly.
// x and y may be the same buffer, hence no __restrict__.

extern "C" __global__ void devbridge_axpy_f32(const float* x, float* y, unsigned long long count, float a,
                                              float b) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    y[i] = __fadd_rn(__fmul_rn(a, x[i]), b);
  }
}
