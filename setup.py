"""Build hook for the optional C accelerator (everything else is in pyproject.toml).

``otel_specdec._rowscan`` is optional: where it cannot be compiled (no C
compiler, an unusual platform), the package installs without it and the
plugin uses its pure-Python accounting.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("otel_specdec._rowscan", ["otel_specdec/_rowscan.c"], optional=True),
    ],
)
