"""tilepy's import graph runs one way — ``tune → ops → tile → ptx`` — and only ``tilepy/ptx/``
makes intrinsics. Read from the sources with ``ast`` (imports at module level and inside
functions alike); nothing is compiled or launched.

* ``tilepy/ops`` imports nothing of ``tilepy.tune`` (the tuner runs the ops, not the reverse);
* ``tilepy/tile`` imports nothing of ``tilepy.ops``, ``tilepy.tune`` or ``tilepy.integrations``;
* ``tilepy/ptx`` imports nothing of ``tilepy.tile``, ``tilepy.ops``, ``tilepy.tune`` or
  ``tilepy.integrations``;
* the stores below the ops (``tilepy/cache.py``, ``tilepy/kcache.py``) import no op and no tuner;
* an ops module uses no private name (leading underscore) of another ops module, imported or
  read as an attribute of the imported module;
* outside ``tilepy/ptx/`` no code names ``intrinsic``, ``InlineAsm`` or ``call_asm``.

Violations that remain in code other changes are still moving are listed in :data:`KNOWN`;
anything else fails, and so does a KNOWN entry that is no longer needed.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "tilepy"

#: (file, name) pairs that break a rule today and are allowed until their code moves. Each
#: must still occur (test_known_entries_are_still_needed): delete an entry once it is gone.
KNOWN = {
    # gemm_softmax_mma_sync's offline report reads the op's tile tables and dtype helper
    ("tilepy/ops/gemm_softmax_mma_sync.py", "_GLOBAL_GPU"),
    ("tilepy/ops/gemm_softmax_mma_sync.py", "_ON_CHIP_GPU"),
    ("tilepy/ops/gemm_softmax_mma_sync.py", "_with_dtype"),
}

#: Which packages each part of tilepy must not import.
FORBIDDEN = {
    "tilepy/ops/": ("tilepy.tune",),
    "tilepy/tile/": ("tilepy.ops", "tilepy.tune", "tilepy.integrations"),
    "tilepy/ptx/": ("tilepy.tile", "tilepy.ops", "tilepy.tune", "tilepy.integrations"),
    "tilepy/cache.py": ("tilepy.ops", "tilepy.tune"),
    "tilepy/kcache.py": ("tilepy.ops", "tilepy.tune"),
}

#: Names that make or emit an intrinsic: only tilepy/ptx/ may use them.
INTRINSIC_NAMES = ("intrinsic", "InlineAsm", "call_asm")


def sources():
    """(path relative to the repository, dotted module name, parsed tree) of every module."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((rel, ".".join(parts), ast.parse(path.read_text(), rel)))
    return out


SOURCES = sources()


def _package(rel: str, module: str) -> str:
    return module if rel.endswith("/__init__.py") else module.rpartition(".")[0]


def _from_target(rel: str, module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from … import`` statement in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    base = _package(rel, module).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(rel: str, module: str, tree):
    """``(line, target module, [names])`` for every import in the tree (relative ones
    resolved), plus ``importlib.import_module`` / ``__import__`` of a constant name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, _from_target(rel, module, node), [a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value, []


def _reaches(target: str, names, package: str) -> bool:
    """Whether importing ``names`` from ``target`` brings in (part of) ``package``."""
    return any(c == package or c.startswith(package + ".")
               for c in [target] + [f"{target}.{n}" for n in names])


def graph_violations():
    """(file, imported module, line, the forbidden package it reaches)."""
    found = []
    for rel, module, tree in SOURCES:
        rules = [bad for where, bad in FORBIDDEN.items()
                 if rel == where or (where.endswith("/") and rel.startswith(where))]
        for line, target, names in imports(rel, module, tree):
            for bad in (b for rule in rules for b in rule):
                if _reaches(target, names, bad):
                    found.append((rel, target, line, bad))
    return found


def _ops_module(dotted: str) -> bool:
    if not dotted.startswith("tilepy.ops."):
        return False
    return (PKG / "ops" / (dotted[len("tilepy.ops."):].replace(".", "/") + ".py")).is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_name_violations():
    """(file, name, line) where an ops module uses a private name of another ops module."""
    found = []
    for rel, module, tree in SOURCES:
        if not rel.startswith("tilepy/ops/"):
            continue
        aliases = {}   # local name -> the other ops module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _from_target(rel, module, node)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if _ops_module(sub) and sub != module:
                        aliases[alias.asname or alias.name] = sub
                    elif _ops_module(target) and target != module and _private(alias.name):
                        found.append((rel, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and _ops_module(alias.name) and alias.name != module:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and _private(node.attr):
                found.append((rel, node.attr, node.lineno))
    return found


def intrinsic_violations():
    """(file, name, line) where code outside tilepy/ptx/ names an intrinsic maker."""
    found = []
    for rel, _, tree in SOURCES:
        if rel.startswith("tilepy/ptx/"):
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom):
                names = [a.asname or a.name for a in node.names] + [a.name for a in node.names]
            for n in set(names) & set(INTRINSIC_NAMES):
                found.append((rel, n, node.lineno))
    return found


def _new(found):
    return sorted({f for f in found if (f[0], f[1]) not in KNOWN})


def test_there_is_something_to_check():
    names = {rel for rel, _, _ in SOURCES}
    assert {"tilepy/ops/gemm.py", "tilepy/tile/rows.py", "tilepy/ptx/asm.py",
            "tilepy/tune/spaces.py", "tilepy/kcache.py", "tilepy/cache.py"} <= names


def test_imports_run_one_way():
    new = _new(graph_violations())
    assert not new, "\n".join(f"{f}:{line} imports {t} ({bad} is above it)"
                              for f, t, line, bad in new)


def test_ops_use_no_private_name_of_another_op():
    new = _new(private_name_violations())
    assert not new, "\n".join(f"{f}:{line} uses {name} of another ops module"
                              for f, name, line in new)


def test_only_ptx_makes_intrinsics():
    new = _new(intrinsic_violations())
    assert not new, "\n".join(f"{f}:{line} names {name}: intrinsics belong in tilepy/ptx/"
                              for f, name, line in new)


def test_known_entries_are_still_needed():
    still = {(f, name) for f, name, *_ in
             graph_violations() + private_name_violations() + intrinsic_violations()}
    assert KNOWN <= still, f"no longer needed, delete from KNOWN: {sorted(KNOWN - still)}"


def test_the_rules_see_what_they_should():
    """The checks themselves: a relative import reaching tune from ops, a private name read
    through a module alias, and an intrinsic decorator are all found."""
    tree = ast.parse("from ..tune.spaces import x\nfrom .. import tune\n"
                     "def f():\n    import tilepy.tune.kcache\n")
    got = [(t, n) for _, t, n in imports("tilepy/ops/x.py", "tilepy.ops.x", tree)]
    assert got == [("tilepy.tune.spaces", ["x"]), ("tilepy", ["tune"]),
                   ("tilepy.tune.kcache", [])]
    assert all(_reaches(t, n, "tilepy.tune") for t, n in got)
    assert not _reaches("tilepy", ["tile"], "tilepy.tune")
    assert _ops_module("tilepy.ops.gemm") and not _ops_module("tilepy.ops.nothing")


def test_importing_an_op_loads_no_tuner():
    """At run time too: ``import tilepy.ops.gemm`` (which imports tilepy and all its ops)
    leaves tilepy.tune unloaded; the former names under tilepy.tune still import."""
    code = ("import sys, tilepy.ops.gemm\n"
            "assert not [m for m in sys.modules if m.startswith('tilepy.tune')], "
            "sorted(m for m in sys.modules if m.startswith('tilepy.tune'))\n"
            "import tilepy.kcache, tilepy.cache, tilepy.ops.softmax as sm\n"
            "from tilepy.tune import kcache, cache, spaces, attention_space, softmax_space\n"
            "from tilepy.tune.kcache import cached_jit\n"
            "assert cached_jit is tilepy.kcache.cached_jit\n"
            "assert cache.TuneCache is tilepy.cache.TuneCache\n"
            "assert spaces.tuned_gemm_config is tilepy.ops.gemm.tuned_gemm_config\n"
            "assert softmax_space.tuned_softmax_plan is sm.tuned_softmax_plan\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kernel_files_are_named_by_mechanism_and_the_former_names_alias_them():
    """Each kernel file says its mechanism; the former module names are the same module
    objects (a config class, a cache, a monkeypatch of either name is one thing)."""
    import importlib

    ops = ROOT / "tilepy" / "ops"
    for old, new in (("gemm_kernel", "gemm_mma_sync"),
                     ("gemm_softmax_kernel", "gemm_softmax_mma_sync"),
                     ("attention_kernel", "attention_mma_sync"),
                     ("attention_backward_kernel", "attention_backward_mma_sync")):
        assert importlib.import_module(f"tilepy.ops.{old}") is \
            importlib.import_module(f"tilepy.ops.{new}")
        assert len((ops / f"{old}.py").read_text().splitlines()) < 12   # an alias only
    aliases = {"gemm_kernel", "gemm_softmax_kernel", "attention_kernel",
               "attention_backward_kernel"}
    with_kernels = {p.stem for p in ops.glob("*.py") if p.stem not in aliases
                    and any(m in p.read_text() for m in ("cuda.jit", "kernel_jit(", "def kernel"))}
    # the row kernels (CUDA cores, no matrix instruction), the KV cache's append copy and the
    # block mask's vote live with their op
    unnamed = {s for s in with_kernels if not s.endswith(("_mma_sync", "_wgmma", "_wgmma_ws",
                                                          "_simt"))}
    assert unnamed == {"softmax", "softmax_backward", "attention_kvcache",
                       "attention_block_mask"}, unnamed
    assert len(with_kernels) >= 10
