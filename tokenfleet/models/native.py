"""Native CPU kernels: plain C compiled on first use with the machine's C compiler, cached, loaded with ctypes.

Optional by design: ``load()`` returns None when no compiler is found, the build fails, or
``TOKENFLEET_NATIVE_KERNELS=0``; callers then use their pure-torch path. The library is built
with ``-fopenmp`` and loaded after torch, so its parallel loops run on torch's own OpenMP
runtime and threads (one pool, no second set of spinning threads).

Cache: ``<cache_dir>/kernels/<name>-<key>.so``, the key a hash of the source and the shared
headers (``csrc/*.h``), the compiler's version, the flags and the CPU's flags (``-march=native``
code must not move to another CPU).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

from tokenfleet import envs

log = structlog.get_logger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno",
         # the clamps in exp_f32 become selects, so the exp loops vectorize: SiLU's values are unchanged; the softmax
         # and sampler sums now add in vector lanes (another order, ulp-level differences, within the checks' bounds)
         "-fno-trapping-math",
         "-ffp-contract=off"]  # no implicit fused multiply-adds: the kernels repeat torch's rounding steps


def compiler() -> str | None:
    for name in (envs.c_compiler(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def load(name: str, defines: tuple[str, ...] = (), include_dirs: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c`` (built once per machine), or None when it cannot be had.
    ``defines``: preprocessor names to set (tests build e.g. the portable variant of a kernel); ``include_dirs``:
    more header folders (tests' emulated AVX-512 build reads SIMDe's)."""
    if not envs.native_kernels():
        return None
    cc = compiler()
    if cc is None:
        log.warning("native_kernels_unavailable", reason="no C compiler found; using the pure-torch path")
        return None
    import torch  # noqa: F401  (loads torch's OpenMP runtime first: the library binds to it)

    source = SOURCE_DIR / f"{name}.c"
    try:
        path = _build(cc, source, [f"-D{d}" for d in defines] + [f"-I{d}" for d in include_dirs])
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native_kernels_unavailable", kernel=name, reason=str(e)[-2000:])
        return None


def _build(cc: str, source: Path, extra: list[str]) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = FLAGS + extra
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, version, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = envs.cache_dir() / "kernels"
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"{cc} failed: {done.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: workers starting together each build, one file wins
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.info("native_kernel_built", path=str(target))
    return target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
