"""The one native piece: kvstore._chain, the prefix hash chain's loop in C (see kvstore/_chain.c).

Everything else about the package lives in pyproject.toml. The extension is optional: it needs a C
compiler and xxHash's header (Debian: libxxhash-dev, which `make` installs). Where either is
missing the build warns and kvstore.keys falls back to its Python loop, which gives the same digests.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._chain",
            sources=["kvstore/_chain.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
