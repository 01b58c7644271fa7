"""Build hook for the optional C accelerator (everything else is in pyproject.toml).

``otel_specdec._rowscan`` is built on Python's limited API (3.10 and later),
so one binary serves every supported Python and the wheel is tagged
``cp310-abi3``. It is optional: where it cannot be compiled (no C compiler,
an unusual platform), the package installs without it and the plugin uses
its pure-Python accounting. ``scripts/build-dist.sh`` builds the published
wheels, with two switches:

* ``OTEL_SPECDEC_PURE=1``: no C pass, a ``py3-none-any`` wheel;
* ``OTEL_SPECDEC_REQUIRE_C=1``: a C pass that fails to build fails the build
  (a binary wheel must never ship without it).
"""

import os

from setuptools import Extension, setup

if os.environ.get("OTEL_SPECDEC_PURE") == "1":
    setup()
else:
    setup(
        ext_modules=[
            # Py_LIMITED_API is set in the source itself, so no build can miss it.
            Extension("otel_specdec._rowscan", ["otel_specdec/_rowscan.c"],
                      optional=os.environ.get("OTEL_SPECDEC_REQUIRE_C") != "1",
                      py_limited_api=True),
        ],
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
