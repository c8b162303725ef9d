"""The sparse FFN's Metal kernels (their sources beside this file, package data read with importlib.resources),
loaded into `mx.fast.metal_kernel`, and the exact
Metal source MLX generates from them, rendered here so that it can be checked on machines without Metal.

Each kernel reads rows of the neuron cache in the image's row format: MLX's affine 4- or 8-bit quantization
or fp16 (`metal/sparse_ffn.h`). Sizes travel as input shapes (`x_shape`, ...), never as inputs of a few
elements, which MLX would place in constant memory; the slot lists have a fixed capacity, padded with -1, so
that nothing recompiles from token to token.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files

from lsparse.errors import LsparseError

METAL_DIR = files(__name__)  # the sources, as installed with the package (a wheel carries them)
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


COMPACT_THREADS = 1024  # compact_active: one threadgroup, Metal's largest


@dataclass(frozen=True)
class KernelSpec:
    inputs: tuple[tuple[str, str], ...]   # (name, dtype)
    outputs: tuple[tuple[str, str], ...]
    template: tuple[str, ...]             # template parameters; the first one varies, GROUP is fixed
    variants: tuple[int, ...]             # the values of the first one that lsparse instantiates
    constant: tuple[str, ...] = ()        # inputs of fewer than 8 elements: MLX puts them in constant memory


KERNELS = {
    "gather_mv": KernelSpec(inputs=(("w", "uint32"), ("slots", "int32"), ("x", "float32")),
                            outputs=(("y", "float32"),), template=("BITS", "GROUP"), variants=BITS),
    "gather_down": KernelSpec(inputs=(("w", "uint32"), ("slots", "int32"), ("a", "float32")),
                              outputs=(("out", "float32"),), template=("BITS", "GROUP"), variants=BITS),
    # CATS 0: ReLU-family gates (pre > cut); 1: SwiGLU images cut by |silu(pre)| > cut
    "compact_active": KernelSpec(inputs=(("pre", "float32"), ("threshold", "float32")),
                                 outputs=(("indices", "int32"), ("count", "int32")), template=("CATS",),
                                 variants=(0, 1), constant=("threshold",)),
}
SOURCES = tuple((name, value) for name, spec in KERNELS.items() for value in spec.variants)


def template_args(name: str, value: int) -> list[tuple[str, int]]:
    """The kernel's template arguments: `value` for the first parameter, GROUP for GROUP."""
    first, *rest = KERNELS[name].template
    return [(first, value)] + [(param, GROUP) for param in rest]


def read_source(name: str) -> tuple[str, str]:
    """(header, body) of a kernel, as installed in lsparse/kernels/metal/."""
    try:
        return (METAL_DIR / HEADER).read_text(), (METAL_DIR / f"{name}.metal").read_text()
    except OSError as e:
        raise LsparseError(f"the Metal sources are missing ({e}); reinstall lsparse") from None


def function_name(name: str, value: int) -> str:
    spec = KERNELS[name]
    types = [C_TYPES[t] + ("c" if arg in spec.constant else "") for arg, t in spec.inputs + spec.outputs]
    values = "".join(f"_{v}" for _, v in template_args(name, value))
    return f"custom_kernel_lsparse_{name}_{values}_" + "_".join(types)


def parameters(name: str) -> list[tuple[str, str, str]]:
    """The kernel function's parameters as MLX writes them: (role, name, C type), role being input, constant
    (a small input), shape (an input's shape, passed when the body names it), output or attribute."""
    _, body = read_source(name)
    spec = KERNELS[name]
    params = []
    for arg, dtype in spec.inputs:
        params.append(("constant" if arg in spec.constant else "input", arg, C_TYPES[dtype]))
        if f"{arg}_shape" in body:
            params.append(("shape", f"{arg}_shape", "int"))
    params += [("output", arg, C_TYPES[dtype]) for arg, dtype in spec.outputs]
    return params + [("attribute", attr, kind) for attr, kind in ATTRIBUTES.items() if attr in body]


def render(name: str, value: int) -> str:
    """The whole Metal source MLX compiles for this kernel: the header, the signature it writes, the body and
    the explicit instantiation. A test holds this byte for byte against what MLX itself prints."""
    header, body = read_source(name)
    params, index = [], 0
    for role, arg, ctype in parameters(name):
        if role == "input":
            params.append(f"  const device {ctype}* {arg} [[buffer({index})]]")
        elif role == "constant":
            params.append(f"  const constant {ctype}* {arg} [[buffer({index})]]")
        elif role == "shape":
            params.append(f"  const constant int* {arg} [[buffer({index})]]")
        elif role == "output":
            params.append(f"  device {ctype}* {arg} [[buffer({index})]]")
        else:
            params.append(f"  {ctype} {arg} [[{arg}]]")
        index += 1
    fn = function_name(name, value)
    args = ", ".join(str(v) for _, v in template_args(name, value))
    declared = ", ".join(f"int {param}" for param in KERNELS[name].template)
    return (f"{header}template <{declared}>\n[[kernel]] void {fn}(\n" + ",\n".join(params)
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


def launch(name: str, n: int, d: int = 0, bits: int = 4) -> tuple[tuple, tuple]:
    """(grid, threadgroup) of a dispatch: n is the slot list's length (compact_active: pre's), d a row's width."""
    if name == "gather_mv":
        return (32, n, 1), (32, THREADGROUP_ROWS, 1)
    if name == "gather_down":
        words = d * bits // 32
        return (words, 1, 1), (min(DOWN_THREADS, words), 1, 1)
    threads = min(COMPACT_THREADS, 32 * -(-n // 32))
    return (threads, 1, 1), (threads, 1, 1)


def gather_mv(w, slots, x, bits: int, verbose: bool = False):
    """y[i] = row(slots[i]) . x: w (slots, row words) uint32, slots (capacity,) int32 padded with -1,
    x (d,) float32; returns (capacity,) float32."""
    import mlx.core as mx
    capacity = slots.shape[0]
    grid, threadgroup = launch("gather_mv", capacity)
    return kernel("gather_mv")(inputs=[w, slots, x], template=template_args("gather_mv", bits), grid=grid,
                               threadgroup=threadgroup, output_shapes=[(capacity,)], output_dtypes=[mx.float32],
                               verbose=verbose)[0]


def gather_down(w, slots, a, bits: int, d: int, verbose: bool = False):
    """out = sum_i a[i] * row(slots[i]): w (slots, row words) uint32 holding down columns, slots and a
    (capacity,), padded with -1 and 0; returns (d,) float32."""
    import mlx.core as mx
    grid, threadgroup = launch("gather_down", slots.shape[0], d, bits)
    return kernel("gather_down")(inputs=[w, slots, a], template=template_args("gather_down", bits), grid=grid,
                                 threadgroup=threadgroup, output_shapes=[(d,)], output_dtypes=[mx.float32],
                                 verbose=verbose)[0]


def compact_active(pre, threshold, cats: bool, verbose: bool = False):
    """(indices, count): the neurons whose pre-activation passes (pre > threshold, or |silu(pre)| > threshold
    with `cats`), ascending, padded with -1 to pre's length; pre (n,) float32, threshold (1,) float32."""
    import mlx.core as mx
    n = pre.shape[0]
    grid, threadgroup = launch("compact_active", n)
    return kernel("compact_active")(inputs=[pre, threshold], template=template_args("compact_active", int(cats)),
                                    grid=grid, threadgroup=threadgroup, output_shapes=[(n,), (1,)],
                                    output_dtypes=[mx.int32, mx.int32], verbose=verbose)
