"""The sparse FFN's Metal kernels (sources in metal/), loaded into `mx.fast.metal_kernel`, and the exact
Metal source MLX generates from them, rendered here so that it can be checked on machines without Metal.

Each kernel reads rows of the neuron cache in the image's row format: MLX's affine 4- or 8-bit quantization
or fp16 (`metal/sparse_ffn.h`). Sizes travel as input shapes (`x_shape`, ...), never as inputs of a few
elements, which MLX would place in constant memory; the slot lists have a fixed capacity, padded with -1, so
that nothing recompiles from token to token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lsparse.errors import LsparseError

METAL_DIR = Path(__file__).resolve().parents[2] / "metal"
HEADER = "sparse_ffn.h"
BITS = (4, 8, 16)
GROUP = 64
THREADGROUP_ROWS = 4   # gather_mv: SIMD groups (rows) per threadgroup
DOWN_THREADS = 256     # gather_down: threads per threadgroup

# MLX passes these to a kernel that names them, in this (sorted) order, with these types
ATTRIBUTES = {"simdgroup_index_in_threadgroup": "uint", "thread_index_in_simdgroup": "uint",
              "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
              "threadgroup_position_in_grid": "uint3", "threads_per_threadgroup": "uint3"}
C_TYPES = {"float32": "float", "float16": "float16_t", "uint32": "uint32_t", "int32": "int32_t"}


@dataclass(frozen=True)
class KernelSpec:
    inputs: tuple[tuple[str, str], ...]   # (name, dtype)
    outputs: tuple[tuple[str, str], ...]


KERNELS = {
    "gather_mv": KernelSpec(inputs=(("w", "uint32"), ("slots", "int32"), ("x", "float32")),
                            outputs=(("y", "float32"),)),
    "gather_down": KernelSpec(inputs=(("w", "uint32"), ("slots", "int32"), ("a", "float32")),
                              outputs=(("out", "float32"),)),
}


def read_source(name: str) -> tuple[str, str]:
    """(header, body) of a kernel, as committed in metal/."""
    try:
        return (METAL_DIR / HEADER).read_text(), (METAL_DIR / f"{name}.metal").read_text()
    except OSError as e:
        raise LsparseError(f"the Metal sources are missing ({e}); lsparse runs its kernels from a source "
                           "checkout (metal/ beside lsparse/)") from None


def function_name(name: str, bits: int) -> str:
    spec = KERNELS[name]
    types = [C_TYPES[t] for _, t in spec.inputs + spec.outputs]
    return f"custom_kernel_lsparse_{name}__{bits}_{GROUP}_" + "_".join(types)


def parameters(name: str) -> list[tuple[str, str, str]]:
    """The kernel function's parameters as MLX writes them: (role, name, C type), role being input, shape
    (an input's shape, passed when the body names it), output or attribute."""
    _, body = read_source(name)
    spec = KERNELS[name]
    params = []
    for arg, dtype in spec.inputs:
        params.append(("input", arg, C_TYPES[dtype]))
        if f"{arg}_shape" in body:
            params.append(("shape", f"{arg}_shape", "int"))
    params += [("output", arg, C_TYPES[dtype]) for arg, dtype in spec.outputs]
    return params + [("attribute", attr, kind) for attr, kind in ATTRIBUTES.items() if attr in body]


def render(name: str, bits: int) -> str:
    """The whole Metal source MLX compiles for this kernel: the header, the signature it writes, the body and
    the explicit instantiation. A test holds this byte for byte against what MLX itself prints."""
    header, body = read_source(name)
    params, index = [], 0
    for role, arg, ctype in parameters(name):
        if role == "input":
            params.append(f"  const device {ctype}* {arg} [[buffer({index})]]")
        elif role == "shape":
            params.append(f"  const constant int* {arg} [[buffer({index})]]")
        elif role == "output":
            params.append(f"  device {ctype}* {arg} [[buffer({index})]]")
        else:
            params.append(f"  {ctype} {arg} [[{arg}]]")
        index += 1
    fn = function_name(name, bits)
    args = f"{bits}, {GROUP}"
    return (f"{header}template <int BITS, int GROUP>\n[[kernel]] void {fn}(\n" + ",\n".join(params)
            + f") {{\n{body}\n}}\n\ntemplate [[host_name(\"{fn}\")]] [[kernel]] decltype({fn}<{args}>) "
            + f"{fn}<{args}>;\n\n")


_compiled = {}


def kernel(name: str):
    """The mx.fast.metal_kernel object of a kernel (made once)."""
    if name not in _compiled:
        import mlx.core as mx
        header, body = read_source(name)
        spec = KERNELS[name]
        _compiled[name] = mx.fast.metal_kernel(name=f"lsparse_{name}", input_names=[n for n, _ in spec.inputs],
                                               output_names=[n for n, _ in spec.outputs], source=body,
                                               header=header)
    return _compiled[name]


def gather_mv(w, slots, x, bits: int, verbose: bool = False):
    """y[i] = row(slots[i]) . x: w (slots, row words) uint32, slots (capacity,) int32 padded with -1,
    x (d,) float32; returns (capacity,) float32."""
    import mlx.core as mx
    capacity = slots.shape[0]
    return kernel("gather_mv")(inputs=[w, slots, x], template=[("BITS", bits), ("GROUP", GROUP)],
                               grid=(32, capacity, 1), threadgroup=(32, THREADGROUP_ROWS, 1),
                               output_shapes=[(capacity,)], output_dtypes=[mx.float32], verbose=verbose)[0]


def gather_down(w, slots, a, bits: int, d: int, verbose: bool = False):
    """out = sum_i a[i] * row(slots[i]): w (slots, row words) uint32 holding down columns, slots and a
    (capacity,), padded with -1 and 0; returns (d,) float32."""
    import mlx.core as mx
    words = d * min(bits, 16) // 32
    return kernel("gather_down")(inputs=[w, slots, a], template=[("BITS", bits), ("GROUP", GROUP)],
                                 grid=(words, 1, 1), threadgroup=(min(DOWN_THREADS, words), 1, 1),
                                 output_shapes=[(d,)], output_dtypes=[mx.float32], verbose=verbose)[0]
