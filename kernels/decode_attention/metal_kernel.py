"""Metal (MLX): single-query GQA decode attention that also writes each key's attention mass.

One threadgroup per KV head reads the heap buffer in place (capacity stride, first
`n_keys` slots): scores of the G query heads go to a [H_q, T] scratch output, then
threadgroup reductions give each head's max and exp-sum, then every thread writes the
mass of its keys and the output columns it owns. Float32 throughout; output in q's dtype.
"""

from __future__ import annotations

import mlx.core as mx

THREADS = 256   # per threadgroup: 8 simdgroups of 32

_SOURCE = """
    const uint h = threadgroup_position_in_grid.x;
    const uint tid = thread_position_in_threadgroup.x;
    const uint lane = thread_index_in_simdgroup;
    const uint simd = simdgroup_index_in_threadgroup;
    const uint n_threads = threads_per_threadgroup.x;
    const uint n_simd = (n_threads + 31) / 32;
    const int T = dims[0];
    const int CAP = dims[1];
    const float sc = scale[0];

    threadgroup float partial[32];
    threadgroup float row_max[G];
    threadgroup float row_sum[G];

    // 1. scaled scores of the G query heads of this KV head, and each thread's max
    float local[G];
    for (int g = 0; g < G; ++g) local[g] = -INFINITY;
    for (int t = tid; t < T; t += n_threads) {
        const device auto* kt = k + ((size_t)h * CAP + t) * D;
        for (int g = 0; g < G; ++g) {
            const device auto* qg = q + (h * G + g) * D;
            float s = 0.0f;
            for (int d = 0; d < D; ++d) s += float(qg[d]) * float(kt[d]);
            s *= sc;
            scores[(size_t)(h * G + g) * T + t] = s;
            local[g] = metal::max(local[g], s);
        }
    }
    threadgroup_barrier(mem_flags::mem_device);
    for (int g = 0; g < G; ++g) {
        float m = simd_max(local[g]);
        if (lane == 0) partial[simd] = m;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (simd == 0) {
            float x = simd_max(lane < n_simd ? partial[lane] : -INFINITY);
            if (lane == 0) row_max[g] = x;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // 2. exp-sums
    for (int g = 0; g < G; ++g) local[g] = 0.0f;
    for (int t = tid; t < T; t += n_threads) {
        for (int g = 0; g < G; ++g) {
            local[g] += metal::exp(scores[(size_t)(h * G + g) * T + t] - row_max[g]);
        }
    }
    for (int g = 0; g < G; ++g) {
        float s = simd_sum(local[g]);
        if (lane == 0) partial[simd] = s;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (simd == 0) {
            float x = simd_sum(lane < n_simd ? partial[lane] : 0.0f);
            if (lane == 0) row_sum[g] = x;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // 3. mass of each key: softmax weights summed over the group
    for (int t = tid; t < T; t += n_threads) {
        float m = 0.0f;
        for (int g = 0; g < G; ++g) {
            m += metal::exp(scores[(size_t)(h * G + g) * T + t] - row_max[g]) / row_sum[g];
        }
        mass[(size_t)h * T + t] = m;
    }

    // 4. output: each thread owns (query head, column) pairs
    for (int i = tid; i < G * D; i += n_threads) {
        const int g = i / D;
        const int d = i % D;
        const device float* sg = scores + (size_t)(h * G + g) * T;
        float acc = 0.0f;
        for (int t = 0; t < T; ++t) {
            acc += metal::exp(sg[t] - row_max[g]) * float(v[((size_t)h * CAP + t) * D + d]);
        }
        out[(h * G + g) * D + d] = static_cast<OutT>(acc / row_sum[g]);
    }
"""

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.metal_kernel(
            name="localheap_decode_attention_mass",
            input_names=["q", "k", "v", "scale", "dims"],
            output_names=["out", "mass", "scores"],
            source=_SOURCE,
        )
    return _KERNEL


def decode_attention_metal(q: mx.array, k: mx.array, v: mx.array, scale: float, n_keys: int):
    """q: [H_q, D]; k, v: [H_kv, capacity, D] full heap buffers, the first n_keys slots attended.
    Returns out [H_q, D] (q's dtype) and mass [H_kv, n_keys] float32."""
    Hq, D = q.shape
    H, cap, _ = k.shape
    assert Hq % H == 0 and 1 <= n_keys <= cap and v.shape == k.shape, (q.shape, k.shape, n_keys)
    G = Hq // H
    out, mass, _ = _kernel()(
        inputs=[q, k, v, mx.array([scale], dtype=mx.float32), mx.array([n_keys, cap], dtype=mx.int32)],
        template=[("G", G), ("D", D), ("OutT", q.dtype)],
        grid=(THREADS * H, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(Hq, D), (H, n_keys), (Hq, n_keys)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    return out, mass
