"""The optional native read-and-hash loop (``_kvstream_native``); everything else is in
pyproject.toml. Without a C compiler the package installs without it and reads in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("_kvstream_native", ["native/kvstream_native.c"],
                             include_dirs=["native"], depends=["native/xxhash.h"],
                             extra_compile_args=["-O3"], optional=True)])
