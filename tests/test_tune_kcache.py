"""The compiled-kernel disk cache (:mod:`tilepy.kcache`; ``tilepy.tune.kcache`` re-exports it).

* In this process (simulator or not): the directory (cache dir, tilepy version, source hash),
  the source hash's invalidation rules, the per-file subdirectories, clearing old builds, the
  simulator no-op and the ``TILEPY_KERNEL_CACHE`` switch.
* In fresh subprocesses without the simulator (no GPU needed): the cache is attached to the
  real generated kernels; keys are stable across processes (different hash seeds) and
  distinct across configs; an entry saved by one process is loaded by the next through
  Numba-CUDA's own cache code (only the kernel object is a stand-in: building a real one needs
  a GPU); a source change, a corrupt index and an unwritable directory behave.
* On a GPU: ``tilepy.gemm`` in two fresh processes — the second loads its kernel from disk.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import tilepy
from tilepy import kcache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


# ---- in this process -------------------------------------------------------------------------

def test_directory_names_version_and_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEPY_CACHE_DIR", str(tmp_path))
    d = kcache.kernel_cache_dir()
    head, tag = os.path.split(d)
    assert head == str(tmp_path / "kernels")
    version, digest = tag.rsplit("-", 1)
    assert version == tilepy.__version__ and len(digest) == 16
    assert digest == kcache.source_hash()
    assert kcache.kernel_cache_dir("/elsewhere") == os.path.join("/elsewhere", "kernels", tag)


def _package(root):
    for rel, text in {"__init__.py": "", "tile/__init__.py": "", "tile/copy.py": "A = 1\n",
                      "ptx/mma.py": "B = 2\n"}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


def test_source_hash_follows_every_source_file_and_only_their_content(tmp_path):
    pkg = _package(tmp_path / "pkg")

    def digest():
        kcache.source_hash.cache_clear()
        return kcache.source_hash(pkg)

    first = digest()
    (tmp_path / "pkg" / "ptx" / "mma.py").write_text("B = 3\n")  # a called module changed
    changed = digest()
    assert changed != first
    (tmp_path / "pkg" / "ptx" / "mma.py").write_text("B = 2\n")
    os.utime(tmp_path / "pkg" / "ptx" / "mma.py", (1, 1))  # same content, other timestamp
    assert digest() == first
    (tmp_path / "pkg" / "tile" / "new.py").write_text("")
    assert digest() != first
    (tmp_path / "pkg" / "tile" / "new.py").unlink()
    (tmp_path / "pkg" / "tile" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "tile" / "__pycache__" / "copy.cpython-311.pyc").write_bytes(b"x")
    (tmp_path / "pkg" / "notes.txt").write_text("not source")
    assert digest() == first
    kcache.source_hash.cache_clear()


def test_subdirectories_per_source_folder():
    assert kcache._subdir(os.path.join(ROOT, "tilepy", "ops", "gemm_mma_sync.py")) == "tilepy-ops"
    assert kcache._subdir(os.path.join(ROOT, "tilepy", "demo.py")) == "tilepy"
    user = kcache._subdir("/home/u/project/kernels.py")
    assert user.startswith(os.path.join("user", "project_"))
    assert user != kcache._subdir("/home/v/project/kernels.py")


def test_switch_and_simulator(monkeypatch):
    for off in ("0", "false", "no", "OFF"):
        monkeypatch.setenv("TILEPY_KERNEL_CACHE", off)
        assert not kcache.enabled()
    monkeypatch.setenv("TILEPY_KERNEL_CACHE", "1")
    assert kcache.enabled()
    if tilepy.SIMULATOR:
        @kcache.cached_jit
        def k(x):
            x[0] = 1

        assert not kcache.is_cached(k)  # nothing is compiled in the simulator


def test_stale_builds_are_listed_and_cleared(tmp_path):
    current = kcache.kernel_cache_dir(str(tmp_path))
    old = tmp_path / "kernels" / "0.0.1-0123456789abcdef"
    os.makedirs(current)
    old.mkdir()
    assert kcache.stale_dirs(str(tmp_path)) == [str(old)]
    assert kcache.clear(str(tmp_path)) == [str(old)]
    assert not old.exists() and os.path.isdir(current)
    assert kcache.clear(str(tmp_path), stale_only=False) == [current]
    assert not os.path.exists(current)
    assert kcache.stale_dirs(str(tmp_path / "missing")) == []


# ---- fresh processes without the simulator ----------------------------------------------------

class FakeCodegen:
    def magic_tuple(self):
        return ("fake CUDA 13.0", (9, 0))


class FakeKernel:
    """Stands in for a compiled ``_Kernel`` (making one needs a GPU): what Numba-CUDA's cache
    implementation reduces and pickles."""

    codegen = FakeCodegen()

    def __init__(self, tag):
        self.tag = tag

    def _reduce_states(self):
        return {"cubin": b"\x7fELF" + self.tag.encode(), "name": self.tag}


class FakeContext:
    def refresh(self):
        pass

    def codegen(self):
        return FakeCodegen()


def _kernels():
    from tilepy.ops import attention_mma_sync, gemm_simt, softmax
    from tilepy.ops.gemm_mma_sync import gemm_kernel
    from tilepy.ops.gemm_wgmma import WgmmaConfig, wgmma_gemm_kernel
    from tilepy.tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout

    small = GemmConfig(BlockTile(64, 64, 32), WarpLayout(2, 2), Pipeline(3))
    return {
        "gemm": gemm_kernel(GemmConfig(), True, "float16"),
        "gemm_again": gemm_kernel.__wrapped__(GemmConfig(), True, "float16"),  # new closures
        "gemm_small": gemm_kernel(small, True, "float16"),
        "gemm_bf16": gemm_kernel(GemmConfig(dtype="bfloat16"), True, "bfloat16"),
        "softmax": softmax.kernel_for(softmax.plan(4096, simulator=False), "float16", False),
        "attention": attention_mma_sync.attention_kernel(
            attention_mma_sync.AttentionConfig(64, dtype="float16"), False, False),
        "simt": gemm_simt.simt_gemm_kernel("gelu", True, True),
        # the same batched kernel source as "gemm", around another block function
        "gemm_wgmma": wgmma_gemm_kernel(WgmmaConfig(), True, "float16"),
    }


def _load(kernel, sig):
    cache = kernel._cache
    cache._impl.rebuild = lambda ctx, payload: payload  # the payload, not a real _Kernel
    return cache.load_overload(sig, FakeContext())


def probe(mode):
    """Runs in a subprocess without the simulator; prints one JSON line."""
    import warnings

    from numba import config

    from tilepy.ops.gemm_mma_sync import argtypes

    assert not config.ENABLE_CUDASIM
    warnings.simplefilter("always")
    sig = argtypes("float16")
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        if mode in ("keys", "save", "load"):
            ks = _kernels()
            out["caches"] = {n: [type(k._cache).__name__, k._cache.cache_path,
                                 repr(k._cache._index_key(sig, FakeCodegen()))]
                             for n, k in ks.items()}
        if mode == "save":
            ks["gemm"]._cache.save_overload(sig, FakeKernel("gemm"))
        if mode == "load":
            out["loaded"] = _load(ks["gemm"], sig)
            out["loaded_small"] = _load(ks["gemm_small"], sig)
            kcache.source_hash.cache_clear()
            real = kcache.source_hash()
            kcache.source_hash = lambda *a: "0" * 16  # tilepy's sources changed
            from tilepy.ops.gemm_mma_sync import gemm_kernel
            from tilepy.tile.config import GemmConfig

            moved = gemm_kernel.__wrapped__(GemmConfig(), True, "float16")
            out["after_source_change"] = [moved._cache.cache_path, _load(moved, sig)]
            kcache.source_hash = lambda *a: real
        if mode == "corrupt":
            ks = _kernels()
            index = ks["gemm"]._cache._cache_file._index_path
            with open(index, "wb") as f:
                f.write(b"\x80\x04garbage")
            out["loaded"] = _load(ks["gemm"], sig)
            out["files"] = sorted(os.listdir(os.path.dirname(index)))
            ks["gemm"]._cache.save_overload(sig, FakeKernel("again"))
            out["reloaded"] = _load(ks["gemm"], sig)
        if mode in ("unwritable", "off"):
            ks = _kernels()
            out["caches"] = {n: [type(k._cache).__name__, kcache.is_cached(k)]
                             for n, k in ks.items()}
        if mode == "user":
            sys.path.insert(0, os.environ["USER_MODULE_DIR"])
            import user_kernels

            k = user_kernels.kernel
            out["cached"] = kcache.is_cached(k)
            out["path"] = k._cache.cache_path
            if os.environ.get("USER_SAVE"):
                k._cache.save_overload(sig, FakeKernel("user"))
            out["loaded"] = _load(k, sig)
    out["warnings"] = [str(w.message) for w in caught if "tilepy" in str(w.message)]
    print(json.dumps(out, default=lambda o: o.decode("latin-1")))


def run_probe(mode, cache_dir, seed="0", **env):
    full = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", TILEPY_CACHE_DIR=str(cache_dir),
                PYTHONHASHSEED=seed, PYTHONPATH=ROOT + os.pathsep + TESTS, **env)
    full.pop("TILEPY_KERNEL_CACHE", None)
    full.update(env)
    code = f"import test_tune_kcache as t; t.probe({mode!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=600, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One process saves the default GEMM kernel's entry, another (other hash seed) loads."""
    d = tmp_path_factory.mktemp("kcache")
    first = run_probe("save", d, seed="1")
    second = run_probe("load", d, seed="2")
    return d, first, second


@pytest.mark.compile
@pytest.mark.xdist_group("kcache_saved")   # one worker makes the fixture
def test_generated_kernels_get_the_cache_with_stable_distinct_keys(saved):
    d, first, second = saved
    assert first["warnings"] == [] and second["warnings"] == []
    tag = f"{tilepy.__version__}-"
    for name, (cls, path, _) in first["caches"].items():
        assert cls == "Cache", name
        assert path.startswith(os.path.join(str(d), "kernels", tag)), path
        assert path.endswith("tilepy-ops")
    keys = {n: c[2] for n, c in first["caches"].items()}
    assert keys == {n: c[2] for n, c in second["caches"].items()}  # stable across processes
    assert keys["gemm"] == keys["gemm_again"]                     # same config, new closures
    distinct = [keys[n] for n in ("gemm", "gemm_small", "gemm_bf16", "softmax", "attention",
                                  "simt", "gemm_wgmma")]
    assert len(set(distinct)) == len(distinct)                    # one entry per config


@pytest.mark.compile
@pytest.mark.xdist_group("kcache_saved")   # one worker makes the fixture
def test_a_second_process_loads_what_the_first_saved(saved):
    _, _, second = saved
    assert second["loaded"] == {"cubin": "\x7fELFgemm", "name": "gemm"}
    assert second["loaded_small"] is None  # another config: not that entry
    files = os.listdir(second["caches"]["gemm"][1])
    assert any(f.endswith(".nbi") for f in files) and any(f.endswith(".nbc") for f in files)


@pytest.mark.compile
@pytest.mark.xdist_group("kcache_saved")   # one worker makes the fixture
def test_a_source_change_starts_a_new_directory(saved):
    _, _, second = saved
    path, loaded = second["after_source_change"]
    assert f"-{'0' * 16}" in path and loaded is None


@pytest.mark.compile
@pytest.mark.xdist_group("kcache_saved")   # one worker makes the fixture
def test_a_corrupt_index_is_set_aside_and_rebuilt(saved):
    d, _, _ = saved
    res = run_probe("corrupt", d)
    assert res["loaded"] is None
    assert any("unreadable" in w for w in res["warnings"]), res["warnings"]
    assert any(".corrupt-" in f for f in res["files"])
    assert res["reloaded"] == {"cubin": "\x7fELFagain", "name": "again"}


@pytest.mark.compile
def test_an_unwritable_directory_warns_once_and_compiles_uncached(tmp_path):
    blocker = tmp_path / "a_file"  # works as root too: the cache "directory" is a file
    blocker.write_text("")
    res = run_probe("unwritable", blocker)
    assert all(c == ["NullCache", False] for c in res["caches"].values()), res["caches"]
    assert len(res["warnings"]) == 1 and "not writable" in res["warnings"][0]


@pytest.mark.compile
def test_switched_off(tmp_path):
    res = run_probe("off", tmp_path, TILEPY_KERNEL_CACHE="0")
    assert all(c == ["NullCache", False] for c in res["caches"].values())
    assert not (tmp_path / "kernels").exists()


@pytest.mark.compile
def test_a_users_kernel_is_stale_when_its_file_changes(tmp_path):
    mod = tmp_path / "mod"
    mod.mkdir()
    source = textwrap.dedent("""
        from tilepy.tune.kcache import cached_jit   # the former name still works

        @cached_jit(max_registers=64)
        def kernel(a, b, out, c, bias, alpha, beta):
            out[0, 0, 0] = a[0, 0, 0]
        """)
    (mod / "user_kernels.py").write_text(source)
    env = {"USER_MODULE_DIR": str(mod)}
    saved = run_probe("user", tmp_path / "c", USER_SAVE="1", **env)
    assert saved["cached"] and os.sep + "user" + os.sep in saved["path"]
    assert saved["loaded"] == {"cubin": "\x7fELFuser", "name": "user"}
    assert run_probe("user", tmp_path / "c", **env)["loaded"] == saved["loaded"]
    (mod / "user_kernels.py").write_text(source + "# edited\n")
    assert run_probe("user", tmp_path / "c", **env)["loaded"] is None


# ---- the GPU ---------------------------------------------------------------------------------

GPU_SCRIPT = """
import json, time
t0 = time.perf_counter()
import numpy as np
from numba import cuda
import tilepy
a = cuda.to_device(np.ones((256, 256), np.float16))
b = cuda.to_device(np.ones((256, 256), np.float16))
t1 = time.perf_counter()
out = tilepy.gemm(a, b)
cuda.synchronize()
t2 = time.perf_counter()
ok = bool((out.copy_to_host() == 256).all())
print(json.dumps({"first_call_s": t2 - t1, "ok": ok}))
"""


@pytest.mark.gpu
def test_second_process_loads_the_gemm_kernel_from_disk(tmp_path):
    env = dict(os.environ, TILEPY_CACHE_DIR=str(tmp_path), NUMBA_DEBUG_CACHE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TILEPY_KERNEL_CACHE", None)
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT], capture_output=True,
                              text=True, env=env, timeout=600, cwd=ROOT, check=False)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        runs.append((json.loads(lines[-1]), lines))
    (cold, cold_log), (warm, warm_log) = runs
    assert cold["ok"] and warm["ok"]
    assert any("data saved to" in ln for ln in cold_log)
    assert any("data loaded from" in ln for ln in warm_log)
    assert not any("data saved to" in ln for ln in warm_log)
    assert os.listdir(kcache.kernel_cache_dir(str(tmp_path)))
    assert warm["first_call_s"] < cold["first_call_s"] / 3, (cold, warm)
