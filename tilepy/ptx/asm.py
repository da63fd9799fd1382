"""Declare a PTX instruction once; get a Numba intrinsic on the GPU and its Python twin in the simulator.

This is the one helper through which every inline-PTX intrinsic of tilepy is made. A
declaration names the operand kinds of the instruction; from it come

* the Numba ``@intrinsic`` (typing with a clear error, casting of integer / float
  arguments, the inline-asm call with its constraint string, tied accumulators, side
  effects, ``convergent`` for ``.sync`` / ``.aligned`` instructions, and a refusal to
  compile for a compute capability that lacks the instruction), and
* under ``NUMBA_ENABLE_CUDASIM=1``, the Python *twin* given with the declaration, which the
  kernel calls instead (the simulator cannot run inline PTX).

Which of the two a name resolves to is decided once, at import, by :data:`SIMULATOR`.

Operand kinds (the letters are PTX register classes / LLVM inline-asm constraints):

=======  ==========  ==========  ============================================
kind     Numba type  constraint  accepts at the call site
=======  ==========  ==========  ============================================
``u32``  uint32      ``r``       any integer (cast)
``i32``  int32       ``r``       any integer (cast)
``u64``  uint64      ``l``       any integer (cast)
``u16``  uint16      ``h``       any integer (cast)
``f32``  float32     ``f``       any float (cast)
``f16``  float16     ``h``       float16 only
=======  ==========  ==========  ============================================
"""

from __future__ import annotations

from dataclasses import dataclass

from numba import config as _numba_config

SIMULATOR: bool = bool(_numba_config.ENABLE_CUDASIM)

#: Every instruction declared through :func:`instruction`, by name: (callable, Instruction).
#: The offline checks compile a probe kernel for each entry.
REGISTRY: dict = {}

_KINDS = ("u32", "i32", "u64", "f32", "f16", "u16")


def _numba_type(kind):
    from numba import types

    return {
        "u32": types.uint32,
        "i32": types.int32,
        "u64": types.uint64,
        "f32": types.float32,
        "f16": types.float16,
        "u16": types.uint16,
    }[kind]


def _llvm_type(kind):
    from llvmlite import ir

    return {
        "u32": ir.IntType(32),
        "i32": ir.IntType(32),
        "u64": ir.IntType(64),
        "f32": ir.FloatType(),
        "f16": ir.IntType(16),  # Numba lowers float16 to i16
        "u16": ir.IntType(16),
    }[kind]


_CONSTRAINT = {"u32": "r", "i32": "r", "u64": "l", "f32": "f", "f16": "h", "u16": "h"}


def accepts(kind, ty) -> bool:
    """Whether a Numba type may be passed where the instruction wants ``kind``."""
    from numba import types

    if kind in ("u32", "i32", "u64", "u16"):
        return isinstance(ty, (types.Integer, types.Boolean))
    if kind == "f32":
        return isinstance(ty, types.Float) and ty.bitwidth >= 32
    if kind == "f16":
        return ty == types.float16
    raise ValueError(kind)


def current_cc():
    """Compute capability being compiled for (inside codegen), or None if unknown."""
    try:
        from numba.core import targetconfig

        return tuple(targetconfig.ConfigStack().top().compute_capability)[:2]
    except Exception:  # no flags on the stack: not inside a CUDA compile
        return None


class UnsupportedTarget(RuntimeError):
    """An intrinsic was compiled for a compute capability that lacks its instruction."""


def require_cc(name: str, min_cc) -> None:
    if min_cc is None:
        return
    cc = current_cc()
    if cc is not None and cc < tuple(min_cc):
        raise UnsupportedTarget(
            f"{name} needs compute capability {min_cc[0]}.{min_cc[1]} or newer; "
            f"this kernel is being compiled for {cc[0]}.{cc[1]}"
        )


def signature_text(name, ins, outs) -> str:
    ret = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
    return f"{name}({', '.join(ins)}) -> {ret}"


def call_asm(builder, template, constraints, out_kinds, in_kinds, args, *,
             side_effect=False, convergent=False):
    """Emit one inline-asm call; return a list of output values (LLVM)."""
    from llvmlite import ir

    if len(out_kinds) == 0:
        ret = ir.VoidType()
    elif len(out_kinds) == 1:
        ret = _llvm_type(out_kinds[0])
    else:
        ret = ir.LiteralStructType([_llvm_type(k) for k in out_kinds])
    fnty = ir.FunctionType(ret, [_llvm_type(k) for k in in_kinds])
    asm = ir.InlineAsm(fnty, template, constraints, side_effect=side_effect)
    attrs = ("convergent",) if convergent else ()
    res = builder.call(asm, list(args), attrs=attrs) if attrs else builder.call(asm, list(args))
    if len(out_kinds) == 0:
        return []
    if len(out_kinds) == 1:
        return [res]
    return [builder.extract_value(res, i) for i in range(len(out_kinds))]


@dataclass(frozen=True)
class Instruction:
    """One inline-PTX instruction with fixed operand kinds.

    ``template`` uses ``$0 …`` for outputs first, then inputs. ``tie`` lists, for the last
    ``len(tie)`` inputs, the output each is tied to (accumulate in place: the input and the
    output share one register, so no copy is made and the template refers to the output's
    number for both).
    """

    name: str
    template: str
    outs: tuple
    ins: tuple
    tie: tuple = ()
    side_effect: bool = False
    convergent: bool = False
    min_cc: tuple | None = None
    clobber_memory: bool = False

    def constraints(self) -> str:
        parts = ["=" + _CONSTRAINT[k] for k in self.outs]
        n_free = len(self.ins) - len(self.tie)
        parts += [_CONSTRAINT[k] for k in self.ins[:n_free]]
        parts += [str(i) for i in self.tie]
        if self.clobber_memory:
            parts.append("~{memory}")
        return ",".join(parts)


def make_intrinsic(spec: Instruction):
    """The Numba intrinsic for ``spec`` (GPU compile path)."""
    from numba import types
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    for k in spec.outs + spec.ins:
        if k not in _KINDS:
            raise ValueError(f"{spec.name}: unknown operand kind {k!r}")
    in_types = [_numba_type(k) for k in spec.ins]
    out_types = [_numba_type(k) for k in spec.outs]
    if len(out_types) == 0:
        ret_type = types.void
    elif len(out_types) == 1:
        ret_type = out_types[0]
    else:
        ret_type = types.Tuple(out_types)
    wanted = signature_text(spec.name, spec.ins, spec.outs)
    constraints = spec.constraints()

    def typer(typingctx, *args):
        if len(args) != len(spec.ins) or not all(accepts(k, t) for k, t in zip(spec.ins, args)):
            given = ", ".join(str(a) for a in args)
            raise TypingError(f"tilepy.ptx: {wanted} cannot take ({given})")
        sig = ret_type(*args)

        def codegen(context, builder, signature, llargs):
            require_cc(spec.name, spec.min_cc)
            cast = [context.cast(builder, v, fr, to)
                    for v, fr, to in zip(llargs, signature.args, in_types)]
            outs = call_asm(builder, spec.template, constraints, spec.outs, spec.ins, cast,
                            side_effect=spec.side_effect, convergent=spec.convergent)
            if len(outs) == 0:
                return context.get_dummy_value()
            if len(outs) == 1:
                return outs[0]
            return context.make_tuple(builder, ret_type, outs)

        return sig, codegen

    # @intrinsic inspects the typer's signature: give it one of the right arity.
    names = [f"a{i}" for i in range(len(spec.ins))]
    src = f"def {spec.name}(typingctx, {', '.join(names)}):\n    return typer(typingctx, {', '.join(names)})\n"
    namespace = {"typer": typer}
    exec(compile(src, f"<tilepy.ptx {spec.name}>", "exec"), namespace)
    fn = intrinsic(namespace[spec.name])
    fn.__doc__ = wanted
    return fn


def instruction(name, template, *, outs=(), ins=(), tie=(), side_effect=False,
                convergent=False, min_cc=None, clobber_memory=False, twin, doc=""):
    """Declare an instruction; return the intrinsic (GPU) or ``twin`` (simulator).

    The returned object carries ``.spec`` (the :class:`Instruction`) and ``.twin`` either way,
    so tests can compare the two and the offline checks can find the PTX it should emit.
    """
    spec = Instruction(name, template, tuple(outs), tuple(ins), tuple(tie), side_effect,
                       convergent, tuple(min_cc) if min_cc else None, clobber_memory)
    if name in REGISTRY:
        raise ValueError(f"tilepy.ptx: instruction {name!r} declared twice")
    fn = twin if SIMULATOR else make_intrinsic(spec)
    REGISTRY[name] = (fn, spec)
    try:
        fn.spec = spec
        fn.twin = twin
        fn.__doc__ = (doc or twin.__doc__ or "") + "\n\n" + signature_text(name, spec.ins, spec.outs)
    except AttributeError:  # pragma: no cover - some Numba objects refuse attributes
        pass
    return fn


def pick(intrinsic_fn, twin):
    """For hand-written intrinsics: the intrinsic on the GPU, the twin in the simulator."""
    fn = twin if SIMULATOR else intrinsic_fn
    try:
        fn.twin = twin
    except AttributeError:  # pragma: no cover
        pass
    return fn
