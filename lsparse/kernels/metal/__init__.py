"""The sparse FFN's Metal kernels (their sources beside this file, package data read with importlib.resources),
loaded into `mx.fast.metal_kernel`, and the exact
Metal source MLX generates from them, rendered here so that it can be checked on machines without Metal.

Each kernel reads rows of the neuron cache in the image's row format: MLX's affine 4- or 8-bit quantization
at groups of 32, 64 or 128, or fp16 (`sparse_ffn.h`); bits and group are template parameters, so each format
is its own instantiation. Sizes travel as input shapes (`x_shape`, ...), never as inputs of a few elements,
which MLX would place in constant memory. Slot lists travel at their own length rounded up to 8, padded
with -1: MLX compiles a kernel once per template, whatever the shapes, so a list that changes length from
token to token recompiles nothing, and the kernels visit only the slots a token uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files

from lsparse.errors import LsparseError

METAL_DIR = files(__name__)  # the sources, as installed with the package (a wheel carries them)
HEADER = "sparse_ffn.h"
BITS = (4, 8, 16)
GROUPS = (32, 64, 128)  # the group sizes `compile --group-size` writes, each a variant of every row kernel
ROWS_PER_SIMDGROUP = 4  # gather_mv, gather_gate_up: rows per SIMD group, sharing x's registers
SIMDGROUPS = 2          # SIMD groups per threadgroup, in every row kernel
DOWN_SPLIT = 64         # gather_down: slots per split (a threadgroup row of the grid), summed afterwards
PAD = 8                 # slot lists travel at their length rounded up to this, padded with -1

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
    template: tuple[str, ...]             # template parameters
    variants: tuple[tuple[int, ...], ...]  # the values of the template parameters that lsparse instantiates
    constant: tuple[str, ...] = ()        # inputs of fewer than 8 elements: MLX puts them in constant memory


def row_formats() -> tuple[tuple[int, int], ...]:
    """(bits, group) of every row format: 4 and 8 bits at each group size, fp16 (group 0: none)."""
    return tuple((bits, group) for bits in BITS if bits != 16 for group in GROUPS) + ((16, 0),)


def kernel_group(bits: int, group: int) -> int:
    """The GROUP a kernel is instantiated with for rows of this format (fp16 rows have no groups: 0)."""
    return 0 if bits == 16 else group


KERNELS = {
    "gather_mv": KernelSpec(inputs=(("w", "uint32"), ("slots", "int32"), ("x", "float32")),
                            outputs=(("y", "float32"),), template=("BITS", "GROUP"), variants=row_formats()),
    # SKIP 1: ReLU-family gates, the up row read only where the gate passes the cut
    "gather_gate_up": KernelSpec(inputs=(("gate_w", "uint32"), ("up_w", "uint32"), ("slots", "int32"),
                                         ("x", "float32"), ("threshold", "float32")),
                                 outputs=(("gate", "float32"), ("up", "float32")), template=("BITS", "GROUP", "SKIP"),
                                 variants=tuple(f + (skip,) for f in row_formats() for skip in (0, 1)),
                                 constant=("threshold",)),
    "gather_down": KernelSpec(inputs=(("w", "uint32"), ("slots", "int32"), ("a", "float32")),
                              outputs=(("partial", "float32"),), template=("BITS", "GROUP"), variants=row_formats()),
    # CATS 0: ReLU-family gates (pre > cut); 1: SwiGLU images cut by |silu(pre)| > cut
    "compact_active": KernelSpec(inputs=(("pre", "float32"), ("threshold", "float32")),
                                 outputs=(("indices", "int32"), ("count", "int32")), template=("CATS",),
                                 variants=((0,), (1,)), constant=("threshold",)),
}
SOURCES = tuple((name, values) for name, spec in KERNELS.items() for values in spec.variants)


def template_args(name: str, values: tuple[int, ...]) -> list[tuple[str, int]]:
    """The kernel's template arguments, for mx.fast.metal_kernel."""
    spec = KERNELS[name]
    if tuple(values) not in spec.variants:
        raise LsparseError(f"lsparse has no {name} kernel for {dict(zip(spec.template, values, strict=False))}")
    return list(zip(spec.template, values, strict=True))


def variant_label(values: tuple[int, ...]) -> str:
    """A variant as file names and test ids spell it: 4-64, 16-0, 4-64-1, 0."""
    return "-".join(map(str, values))


def read_source(name: str) -> tuple[str, str]:
    """(header, body) of a kernel, as installed in lsparse/kernels/metal/."""
    try:
        return (METAL_DIR / HEADER).read_text(), (METAL_DIR / f"{name}.metal").read_text()
    except OSError as e:
        raise LsparseError(f"the Metal sources are missing ({e}); reinstall lsparse") from None


def function_name(name: str, values: tuple[int, ...]) -> str:
    spec = KERNELS[name]
    types = [C_TYPES[t] + ("c" if arg in spec.constant else "") for arg, t in spec.inputs + spec.outputs]
    values = "".join(f"_{v}" for _, v in template_args(name, values))
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


def render(name: str, values: tuple[int, ...]) -> str:
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
    fn = function_name(name, values)
    args = ", ".join(str(v) for _, v in template_args(name, values))
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


def padded_length(n: int) -> int:
    """A slot list's length as sent: its own, rounded up to PAD (the rest -1)."""
    return -(-n // PAD) * PAD


def launch(name: str, n: int, d: int = 0, bits: int = 4) -> tuple[tuple, tuple]:
    """(grid, threadgroup) of a dispatch: n is the slot list's length (compact_active: pre's), d a row's width."""
    if name in ("gather_mv", "gather_gate_up"):
        simdgroups = -(-n // ROWS_PER_SIMDGROUP)
        return (32, SIMDGROUPS * -(-simdgroups // SIMDGROUPS), 1), (32, SIMDGROUPS, 1)
    if name == "gather_down":
        blocks = -(-d // (32 * (128 // bits)))
        return (32 * blocks, SIMDGROUPS * down_splits(n), 1), (32, SIMDGROUPS, 1)
    threads = min(COMPACT_THREADS, 32 * -(-n // 32))
    return (threads, 1, 1), (threads, 1, 1)


def down_splits(n: int) -> int:
    """gather_down's splits of an n-slot list: the rows of its partial sums."""
    return -(-n // DOWN_SPLIT)


def gather_mv(w, slots, x, bits: int, group: int, verbose: bool = False):
    """y[i] = row(slots[i]) . x: w (slots, row words) uint32, slots (n,) int32 (-1: padding, 0 out), x (d,)
    float32; returns (n,) float32."""
    import mlx.core as mx
    n = slots.shape[0]
    if n == 0:
        return mx.zeros((0,), dtype=mx.float32)
    grid, threadgroup = launch("gather_mv", n)
    return kernel("gather_mv")(inputs=[w, slots, x], template=template_args("gather_mv", (bits, group)), grid=grid,
                               threadgroup=threadgroup, output_shapes=[(n,)], output_dtypes=[mx.float32],
                               verbose=verbose)[0]


def gather_gate_up(gate_w, up_w, slots, x, threshold, bits: int, group: int, skip: bool, verbose: bool = False):
    """(gate, up), each (n,) float32: both rows of each slot dotted with x in one pass; with `skip`, up is
    computed only where gate > threshold[0] (0 elsewhere). gate_w and up_w (slots, row words) uint32 in the
    same slots, threshold (1,) float32."""
    import mlx.core as mx
    n = slots.shape[0]
    if n == 0:
        return mx.zeros((0,), dtype=mx.float32), mx.zeros((0,), dtype=mx.float32)
    grid, threadgroup = launch("gather_gate_up", n)
    return tuple(kernel("gather_gate_up")(
        inputs=[gate_w, up_w, slots, x, threshold], template=template_args("gather_gate_up", (bits, group, int(skip))),
        grid=grid, threadgroup=threadgroup, output_shapes=[(n,), (n,)], output_dtypes=[mx.float32, mx.float32],
        verbose=verbose))


def gather_down_partial(w, slots, a, bits: int, group: int, d: int, verbose: bool = False):
    """(splits, d) float32: split s holds sum_i a[i] * row(slots[i]) over slots [64 s, 64 s + 64)."""
    import mlx.core as mx
    n = slots.shape[0]
    grid, threadgroup = launch("gather_down", n, d, bits)
    return kernel("gather_down")(inputs=[w, slots, a], template=template_args("gather_down", (bits, group)),
                                 grid=grid, threadgroup=threadgroup, output_shapes=[(down_splits(n), d)],
                                 output_dtypes=[mx.float32], verbose=verbose)[0]


def gather_down(w, slots, a, bits: int, group: int, d: int, verbose: bool = False):
    """out = sum_i a[i] * row(slots[i]): w (slots, row words) uint32 holding down columns, slots and a (n,),
    -1 and 0 where padded; returns (d,) float32: the kernel's partial sums, summed by MLX (no host trip)."""
    import mlx.core as mx
    if slots.shape[0] == 0:
        return mx.zeros((d,), dtype=mx.float32)
    return gather_down_partial(w, slots, a, bits, group, d, verbose).sum(axis=0)


def compact_active(pre, threshold, cats: bool, verbose: bool = False):
    """(indices, count): the neurons whose pre-activation passes (pre > threshold, or |silu(pre)| > threshold
    with `cats`), ascending, padded with -1 to pre's length; pre (n,) float32, threshold (1,) float32."""
    import mlx.core as mx
    n = pre.shape[0]
    grid, threadgroup = launch("compact_active", n)
    return kernel("compact_active")(inputs=[pre, threshold], template=template_args("compact_active", (int(cats),)),
                                    grid=grid, threadgroup=threadgroup, output_shapes=[(n,), (1,)],
                                    output_dtypes=[mx.int32, mx.int32], verbose=verbose)
