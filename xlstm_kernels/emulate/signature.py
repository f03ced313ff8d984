"""Byte-exact reproduction of the kernel text MLX generates for ``mx.fast.metal_kernel``.

``mx.fast.metal_kernel(name, input_names, output_names, source, header, ...)``
only receives the *body* of a Metal kernel.  When the returned callable is
invoked, MLX (``mlx/backend/common/metal_kernel.cpp``, functions
``write_signature``, ``write_template``, ``make_template_hash`` and the
kernel-name logic in ``metal_kernel``) builds the full Metal source::

    <header>
    template <typename T, int N, bool B>            # only with template args
    [[kernel]] void <kernel name>(
      const device float* inp [[buffer(0)]],
      const constant int* inp_shape [[buffer(1)]],  # if "inp_shape" in source
      ...
      device float16_t* out [[buffer(k)]],
      uint3 thread_position_in_grid [[thread_position_in_grid]]) {
    <source>
    }

    template [[host_name("<kernel name>")]] [[kernel]] decltype(<name><T..>) <name><T..>;

This module recomputes that text in pure Python, so that the CPU emulator can
compile exactly what MLX would hand to the Metal compiler (the Metal back-end
compiles ``metal::utils() + source``; that prefix is *not* part of the text
produced here).  The reference is MLX 0.32.x; ``tests/emulate/
test_signature_golden.py`` compares the output with MLX itself byte for byte.

MLX quirks reproduced on purpose
--------------------------------
* Attribute and ``<input>_shape``/``_strides``/``_ndim`` detection is a plain
  substring search of ``source`` (never ``header``): a mention in a comment, or
  inside a longer identifier (``data_shape`` contains ``a_shape``), counts.
* Attributes are emitted in the fixed order of :data:`ATTRIBUTES`
  (alphabetical), not in the order they appear in the body.
* Shape/strides/ndim buffers are only emitted for inputs with ``ndim > 0``.
* The separator after each *output* parameter is chosen by comparing the
  running buffer index with ``len(inputs) + len(outputs) - 1``.  The buffer
  index also counts shape/strides/ndim buffers, so when such buffers exist,
  there are at least two outputs and no attributes, MLX closes the parameter
  list early (``) {``) after an output that is not the last one, producing
  source that does not compile.  This is reproduced verbatim.
* The header is pasted verbatim; if it does not end with a newline the
  ``template <...>``/``[[kernel]]`` line continues on the header's last line.
* In the kernel-name hash of the template arguments, ``<``, ``>``, ``", "``
  and ``-`` (negative ints) all become ``_`` and the final ``_`` is dropped:
  ``<float, -16, 1>`` -> ``_float__16_1``.  The user-given ``name`` is used
  unchanged (no sanitisation).
* Template bools are printed as ``1``/``0``; the verbose dump ends with the
  source, an extra empty line, then the closing fence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Tuple, Union

import mlx.core as mx

__all__ = [
    "ATTRIBUTES",
    "MAX_CONSTANT_ARRAY_SIZE",
    "TemplateValue",
    "TemplateArgs",
    "dtype_type_name",
    "InputSpec",
    "input_specs",
    "detect_shape_infos",
    "detect_attributes",
    "template_string",
    "template_hash",
    "kernel_name",
    "ParamSpec",
    "GeneratedKernel",
    "generate",
    "format_verbose",
]

#: Inputs with fewer elements than this are passed in the ``constant``
#: address space (``max_constant_array_size`` in MLX).
MAX_CONSTANT_ARRAY_SIZE: int = 8

#: The Metal kernel attributes MLX looks for (substring search of the body),
#: in the exact order in which they are appended to the signature, as
#: ``(attribute name, Metal type)``.
ATTRIBUTES: Tuple[Tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

#: A template argument value: ``bool``, ``int`` (C++ ``int`` range) or an
#: ``mx.Dtype``.
TemplateValue = Union[bool, int, mx.Dtype]
#: Template arguments as MLX takes them: ordered ``(name, value)`` pairs.
TemplateArgs = Sequence[Tuple[str, TemplateValue]]

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1

# get_type_string() in mlx/backend/common/compiled.cpp
_TYPE_NAMES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float64: "double",
    mx.complex64: "complex64_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}


def dtype_type_name(dtype: mx.Dtype) -> str:
    """Return the Metal/C++ type name MLX uses for ``dtype``.

    Mirrors ``get_type_string``: ``float32 -> "float"``, ``float16 ->
    "float16_t"``, ``bfloat16 -> "bfloat16_t"``, ``float64 -> "double"``,
    ``complex64 -> "complex64_t"``, ``bool_ -> "bool"`` and ``intN``/``uintN``
    -> ``"intN_t"``/``"uintN_t"``.

    Raises:
        TypeError: ``dtype`` is not an ``mx.Dtype``.
        ValueError: MLX has no type name for it.
    """
    if not isinstance(dtype, mx.Dtype):
        raise TypeError(f"expected an mlx.core.Dtype, got {type(dtype).__name__}: {dtype!r}")
    try:
        return _TYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"Unsupported compilation type {dtype}") from None


@dataclass(frozen=True)
class InputSpec:
    """What MLX's signature generation needs to know about one input array.

    Attributes:
        name: parameter name (must equal the matching entry of ``input_names``).
        dtype: the array's dtype.
        ndim: number of dimensions; ``0`` means the input is passed by
            reference (``const constant T& name``) and never gets
            shape/strides/ndim buffers.
        size: element count; inputs with ``size < 8`` live in ``constant``
            space, the others in ``device`` space.
    """

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"InputSpec.name must be a str, got {type(self.name).__name__}")
        dtype_type_name(self.dtype)  # validates
        for attr in ("ndim", "size"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"InputSpec.{attr} must be an int, got {type(v).__name__}")
            if v < 0:
                raise ValueError(f"InputSpec.{attr} must be >= 0, got {v}")
        if self.ndim == 0 and self.size != 1:
            raise ValueError(f"a 0-d input has exactly one element, got size={self.size}")

    @property
    def type_name(self) -> str:
        """C++ element type name (see :func:`dtype_type_name`)."""
        return dtype_type_name(self.dtype)

    @property
    def address_space(self) -> str:
        """``"constant"`` if ``size < 8`` else ``"device"``."""
        return "constant" if self.size < MAX_CONSTANT_ARRAY_SIZE else "device"

    @property
    def is_scalar(self) -> bool:
        """True for 0-d inputs (passed by reference, ``&``)."""
        return self.ndim == 0

    @property
    def name_suffix(self) -> str:
        """Kernel-name suffix: ``"s"`` for 0-d, ``"c"`` for constant, else ``""``."""
        if self.ndim == 0:
            return "s"
        if self.size < MAX_CONSTANT_ARRAY_SIZE:
            return "c"
        return ""

    @classmethod
    def from_value(cls, name: str, value: object) -> "InputSpec":
        """Build the spec for a value as MLX would receive it in ``inputs=``.

        ``mx.array`` values are described as they are; Python scalars are
        converted like MLX does (``float -> 0-d float32``, ``int -> 0-d int32``
        (``int64`` outside the int32 range), ``bool -> 0-d bool``,
        ``complex -> 0-d complex64``); anything else goes through
        ``mx.array(value)``.
        """
        arr = value if isinstance(value, mx.array) else mx.array(value)
        return cls(name=name, dtype=arr.dtype, ndim=arr.ndim, size=arr.size)


def input_specs(input_names: Sequence[str], values: Sequence[object]) -> list[InputSpec]:
    """Return ``[InputSpec.from_value(n, v) for n, v in zip(input_names, values)]``.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(input_names) != len(values):
        raise ValueError(
            f"[metal_kernel] Expected `inputs` to have size {len(input_names)} "
            f"but got size {len(values)}."
        )
    return [InputSpec.from_value(n, v) for n, v in zip(input_names, values)]


def detect_shape_infos(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """For each input name ``n``, whether ``n_shape``, ``n_strides``, ``n_ndim``
    occur as substrings of ``source`` (the kernel body, not the header)."""
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def detect_attributes(source: str) -> list[tuple[str, str]]:
    """The ``(attribute, Metal type)`` pairs of :data:`ATTRIBUTES` whose name is a
    substring of ``source`` (the body, not the header), in :data:`ATTRIBUTES`
    order."""
    return [(attr, ty) for attr, ty in ATTRIBUTES if attr in source]


def _check_template_args(template_args: TemplateArgs | None) -> tuple[tuple[str, TemplateValue], ...]:
    """Validate and freeze template arguments (bool is tested before int)."""
    if template_args is None:
        return ()
    out = []
    for item in template_args:
        try:
            tname, value = item
        except (TypeError, ValueError):
            raise TypeError(
                f"template arguments must be (name, value) pairs, got {item!r}"
            ) from None
        if not isinstance(tname, str):
            raise TypeError(f"template argument name must be a str, got {type(tname).__name__}")
        if isinstance(value, bool):
            pass
        elif isinstance(value, int):
            if not _INT32_MIN <= value <= _INT32_MAX:
                raise ValueError(
                    f"template argument {tname!r}={value} does not fit in a C++ int "
                    f"[{_INT32_MIN}, {_INT32_MAX}]"
                )
        elif isinstance(value, mx.Dtype):
            dtype_type_name(value)
        else:
            raise TypeError(
                f"invalid template argument {tname!r}={value!r} "
                f"({type(value).__name__}); must be `mlx.core.Dtype`, `int` or `bool`"
            )
        out.append((tname, value))
    return tuple(out)


def _template_value_text(value: TemplateValue) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return dtype_type_name(value)


def _template_param_kind(value: TemplateValue) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return "typename"


def template_string(template_args: TemplateArgs | None) -> str:
    """The template-argument list MLX writes (``write_template``).

    ``[("T", mx.float32), ("N", 16), ("B", True)] -> "<float, 16, 1>"``: ints
    in decimal, bools as ``1``/``0``, dtypes by :func:`dtype_type_name`.
    Returns ``""`` for no template arguments (MLX then emits no template).

    Raises:
        TypeError: a value is not bool/int/``mx.Dtype`` or a name is not a str.
        ValueError: an int does not fit in a C++ ``int``.
    """
    args = _check_template_args(template_args)
    if not args:
        return ""
    return "<" + ", ".join(_template_value_text(v) for _, v in args) + ">"


def template_hash(template: TemplateArgs | str | None) -> str:
    """The kernel-name fragment MLX derives from the template-argument list.

    Accepts either the template arguments or an already formatted
    :func:`template_string`.  ``<`` and ``>`` become ``_``, each ``", "`` becomes
    ``_``, ``-`` becomes ``_`` (MLX 0.32.4 behaviour), and the trailing ``_``
    is dropped: ``"<float, 16, 1>" -> "_float_16_1"``.  Returns ``""`` for
    no template arguments.
    """
    tdef = template if isinstance(template, str) else template_string(template)
    if not tdef:
        return ""
    out = []
    i = 0
    n = len(tdef)
    while i < n:
        c = tdef[i]
        if c in "<>-":
            out.append("_")
        elif c == "," and i + 1 < n and tdef[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def kernel_name(
    name: str,
    template_args: TemplateArgs | None,
    inputs: Sequence[InputSpec],
    output_dtypes: Sequence[mx.Dtype],
) -> str:
    """The full (host) kernel name MLX gives the generated kernel.

    ``"custom_kernel_" + name``, then ``"_" + template_hash`` when templated,
    then for each input ``"_" + type name`` plus ``"s"`` (0-d) or ``"c"``
    (fewer than 8 elements), then ``"_" + type name`` per output dtype, e.g.
    ``custom_kernel_myexp__float_16_1_float_floats_int32_tc_float16_t``.
    """
    parts = ["custom_kernel_", name]
    th = template_hash(template_args)
    if th:
        parts += ["_", th]
    for spec in inputs:
        parts += ["_", spec.type_name, spec.name_suffix]
    for dt in output_dtypes:
        parts += ["_", dtype_type_name(dt)]
    return "".join(parts)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the generated kernel signature, in signature order.

    Attributes:
        kind: ``"input"``, ``"shape"``, ``"strides"``, ``"ndim"``, ``"output"``
            or ``"attribute"``.
        ctype: the C++ type text as written, e.g. ``"const device float*"``,
            ``"const constant float&"``, ``"const constant int*"`` (shape),
            ``"const constant int64_t*"`` (strides), ``"const constant int&"``
            (ndim), ``"device atomic<float>*"``, ``"uint3"``.
        name: the parameter name (``inp``, ``inp_shape``, ``out``,
            ``thread_position_in_grid``...).
        index: for input/shape/strides/ndim the input index, for outputs the
            output index, for attributes the position among the attributes.
        buffer: the ``[[buffer(i)]]`` index, ``None`` for attributes.
        attribute: the Metal attribute name for attributes, else ``None``.
    """

    kind: str
    ctype: str
    name: str
    index: int
    buffer: int | None = None
    attribute: str | None = None


@dataclass
class GeneratedKernel:
    """The result of :func:`generate`.

    Attributes:
        name: full kernel name (also the ``host_name``), see :func:`kernel_name`.
        source: the complete kernel text MLX builds (and compiles after
            ``metal::utils()``).  MLX's verbose dump prints it followed by one
            extra newline; see :func:`format_verbose`.
        params: signature parameters in order (:class:`ParamSpec`).
        template_args: the validated template arguments (may be empty).
        instantiation: the template-id used in the explicit instantiation,
            ``name + template_string`` (``custom_kernel_x_..<float, 16>``), or
            just ``name`` when untemplated.
        header_start: offset of the header in ``source`` (always 0).
        header_end: offset just past the header.
        signature_start: offset of ``template <``/``[[kernel]]`` (== header_end).
        body_start: offset of the user ``source`` body inside ``source``.
        body_end: offset just past the body (before ``"\\n}\\n"``).
        header_line: 1-based line of ``source`` on which the header starts.
        body_line: 1-based line of ``source`` on which the body starts (the
            body always starts at the beginning of a line).
        base_name: the user-given kernel name.
        template_def: :func:`template_string` of the template args (``""`` if none).
        attributes: the detected ``(attribute, type)`` pairs (:func:`detect_attributes`).
        shape_infos: per input, ``(shape, strides, ndim)`` detection flags
            (:func:`detect_shape_infos`; buffers are only emitted for ndim > 0).
    """

    name: str
    source: str
    params: list[ParamSpec]
    template_args: tuple[tuple[str, TemplateValue], ...]
    instantiation: str
    header_start: int
    header_end: int
    signature_start: int
    body_start: int
    body_end: int
    header_line: int
    body_line: int
    base_name: str = ""
    template_def: str = ""
    attributes: list[tuple[str, str]] = field(default_factory=list)
    shape_infos: list[tuple[bool, bool, bool]] = field(default_factory=list)

    @property
    def is_templated(self) -> bool:
        return bool(self.template_args)


def generate(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    inputs: Sequence[InputSpec] = (),
    output_dtypes: Sequence[mx.Dtype] = (),
    template_args: TemplateArgs | None = None,
    atomic_outputs: bool = False,
) -> GeneratedKernel:
    """Build the kernel text MLX generates for one ``metal_kernel`` call.

    Args:
        name, input_names, output_names, source, header, atomic_outputs: as
            passed to ``mx.fast.metal_kernel``.
        inputs: one :class:`InputSpec` per input name (same order, same names);
            see :meth:`InputSpec.from_value` / :func:`input_specs`.
        output_dtypes, template_args: as passed to the kernel call
            (``output_dtypes=``, ``template=``).

    Raises:
        ValueError: no outputs, length mismatches, or an input spec whose name
            differs from its ``input_names`` entry; int template arg out of
            range.
        TypeError: bad template argument or dtype types.
    """
    input_names = list(input_names)
    output_names = list(output_names)
    inputs = list(inputs)
    output_dtypes = list(output_dtypes)
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    for what, actual, expected in (
        ("inputs", len(inputs), len(input_names)),
        ("output_dtypes", len(output_dtypes), len(output_names)),
    ):
        if actual != expected:
            raise ValueError(
                f"[metal_kernel] Expected `{what}` to have size {expected} but got size {actual}."
            )
    for i, (n, spec) in enumerate(zip(input_names, inputs)):
        if not isinstance(spec, InputSpec):
            raise TypeError(f"inputs[{i}] must be an InputSpec, got {type(spec).__name__}")
        if spec.name != n:
            raise ValueError(f"inputs[{i}].name is {spec.name!r} but input_names[{i}] is {n!r}")
    tmpl = _check_template_args(template_args)
    out_types = [dtype_type_name(dt) for dt in output_dtypes]

    shape_infos = detect_shape_infos(source, input_names)
    attributes = detect_attributes(source)
    kname = kernel_name(name, tmpl, inputs, output_dtypes)

    parts: list[str] = [header]
    pos = len(header)
    params: list[ParamSpec] = []

    def emit(text: str) -> None:
        nonlocal pos
        parts.append(text)
        pos += len(text)

    header_end = pos
    if tmpl:
        emit(
            "template <"
            + ", ".join(f"{_template_param_kind(v)} {n}" for n, v in tmpl)
            + ">\n"
        )
    emit(f"[[kernel]] void {kname}(\n")

    index = 0
    for i, (n, spec) in enumerate(zip(input_names, inputs)):
        ref = "&" if spec.ndim == 0 else "*"
        ctype = f"const {spec.address_space} {spec.type_name}{ref}"
        emit(f"  {ctype} {n} [[buffer({index})]],\n")
        params.append(ParamSpec("input", ctype, n, i, index))
        index += 1
        if spec.ndim > 0:
            has_shape, has_strides, has_ndim = shape_infos[i]
            for present, kind, ctype in (
                (has_shape, "shape", "const constant int*"),
                (has_strides, "strides", "const constant int64_t*"),
                (has_ndim, "ndim", "const constant int&"),
            ):
                if present:
                    pname = f"{n}_{kind}"
                    emit(f"  {ctype} {pname} [[buffer({index})]],\n")
                    params.append(ParamSpec(kind, ctype, pname, i, index))
                    index += 1

    last = len(inputs) + len(output_names) - 1
    for j, (n, tname) in enumerate(zip(output_names, out_types)):
        elem = f"atomic<{tname}>" if atomic_outputs else tname
        ctype = f"device {elem}*"
        # MLX compares the *buffer* index (which counts shape/strides/ndim
        # buffers too) with the number of inputs + outputs: reproduced as is.
        sep = ",\n" if (index < last or attributes) else ") {\n"
        emit(f"  {ctype} {n} [[buffer({index})]]{sep}")
        params.append(ParamSpec("output", ctype, n, j, index))
        index += 1

    for k, (attr, ty) in enumerate(attributes):
        sep = ",\n" if k < len(attributes) - 1 else ") {\n"
        emit(f"  {ty} {attr} [[{attr}]]{sep}")
        params.append(ParamSpec("attribute", ty, attr, k, None, attr))

    body_start = pos
    emit(source)
    body_end = pos
    emit("\n}\n")

    tdef = template_string(tmpl)
    instantiation = kname + tdef
    if tmpl:
        emit(
            f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({instantiation}) '
            f"{instantiation};\n"
        )

    text = "".join(parts)
    return GeneratedKernel(
        name=kname,
        source=text,
        params=params,
        template_args=tmpl,
        instantiation=instantiation,
        header_start=0,
        header_end=header_end,
        signature_start=header_end,
        body_start=body_start,
        body_end=body_end,
        header_line=1,
        body_line=text.count("\n", 0, body_start) + 1,
        base_name=name,
        template_def=tdef,
        attributes=attributes,
        shape_infos=shape_infos,
    )


def format_verbose(name: str, generated: GeneratedKernel | str) -> str:
    """Exactly what MLX writes to stdout for ``verbose=True``::

        Generated source code for `<name>`:
        ```
        <source>          (source already ends in "\\n"; MLX adds one more)
        ```

    ``name`` is the user-given kernel name; ``generated`` a
    :class:`GeneratedKernel` or its ``source`` text.
    """
    src = generated if isinstance(generated, str) else generated.source
    return f"Generated source code for `{name}`:\n```\n{src}\n```\n"
