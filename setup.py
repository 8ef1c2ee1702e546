"""Build hook for the one compiled piece of dualpath: the gateway's GIL-free block read.

Everything else is in pyproject.toml. ``optional=True``: where no C compiler (or no Python
headers) is present the install still succeeds and the gateway reads blocks through its
Python path (storage_gateway/backend_fs.py; the gateway's status reports which one it uses).
"""

import platform

from setuptools import Extension, setup

NATIVE = "storage_gateway/native"
sources = [f"{NATIVE}/blockread.c", f"{NATIVE}/xxhash.c"]
macros = []
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    # xxHash's runtime dispatch (AVX-512/AVX2/SSE2), baseline flags: as the xxhash package builds
    sources.append(f"{NATIVE}/xxh_x86dispatch.c")
    macros.append(("XXHASH_X86_DISPATCH", "1"))

setup(ext_modules=[Extension(
    "storage_gateway._blockread",
    sources=sources,
    depends=[f"{NATIVE}/xxhash.h", f"{NATIVE}/xxh_x86dispatch.h"],
    include_dirs=[NATIVE],
    define_macros=macros,
    extra_compile_args=["-O2"],
    optional=True,
)])
