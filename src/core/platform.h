// Lets the shared math compile as host code (g++) and as device code (nvcc).
#pragma once
#if defined(__CUDACC__)
#define FL_HD __host__ __device__ __forceinline__
#else
#define FL_HD inline
#endif

// Loop unrolling hint that host compilers without the pragma ignore quietly.
#if defined(__CUDACC__)
#define FL_UNROLL _Pragma("unroll")
#else
#define FL_UNROLL
#endif
