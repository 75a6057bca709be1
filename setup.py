"""Package discovery, and the optional ahead-of-time build of the C++ CPU kernels.

The kernel sources live in ``colfunc/kernels/``: Triton modules, and the C++ sources under
``csrc/``, shipped as package data for the build on first use.

``COLFUNC_BUILD_EXT=1 pip install --no-build-isolation -e .`` compiles the CPU Adam and decode attention now (it needs
torch in the build environment, hence no build isolation); otherwise it compiles on first use.
"""

import os

from setuptools import find_namespace_packages, setup

packages = find_namespace_packages(
    include=["colfunc", "colfunc.*"], exclude=["*.__pycache__", "colfunc.kernels.csrc"]
)
ext_modules = []
cmdclass = {}
if os.environ.get("COLFUNC_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # the flags of colfunc/kernels/cpu_build.py's FLAGS, which the on-first-use build passes
    flags = {
        "cpu_adam": ["-O3", "-fopenmp", "-ffp-contract=off"],
        "cpu_attention": ["-O3", "-fopenmp"],
    }
    ext_modules = [
        CppExtension(
            f"colfunc.kernels._{name}",
            [f"colfunc/kernels/csrc/{name}.cpp"],
            extra_compile_args=cflags,
            extra_link_args=["-fopenmp"],
        )
        for name, cflags in flags.items()
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(
    packages=packages,
    package_data={"colfunc.kernels": ["csrc/*.cpp"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
