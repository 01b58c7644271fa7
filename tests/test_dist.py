"""The published artefacts, built as a maintainer builds them
(``scripts/build-dist.sh``), and installed as users install them.

* Every artefact is built and passes the script's own checks (auditwheel,
  abi3audit, twine, check-wheel-contents); the wheel names carry the tags.
* Each binary wheel's C pass is an ELF for its architecture that needs
  nothing newer than glibc 2.17 and only the stable ABI (abi3audit, run
  here again on the wheel).
* The x86_64 wheel, installed into a fresh venv beside vLLM with no C
  compiler on PATH, serves a real engine: its C pass takes the steps and the
  received totals equal vLLM's counters.
* The aarch64 wheel's C pass imports under an arm64 Python in
  ``qemu-aarch64-static`` and gives the exact path's totals on a replayed
  stream of steps (``accounting_replay.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from engine_child import run_in_child, shutdown_evidence, with_child_site
from fault_helpers import clean_env

from otel_specdec.demo.receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parent.parent
DIST_VENV = ROOT / "build" / "dist-venv"
REPLAY = Path(__file__).with_name("accounting_replay.py")
# The oldest glibc the binary wheels promise (manylinux2014).
GLIBC_MAX = (2, 17)
ELF_MACHINE = {"x86_64": 62, "aarch64": 183}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-dist.sh")],
        env={**os.environ, "DIST_OUT": str(out), "DIST_VENV": str(DIST_VENV)},
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def _wheel(dist: Path, tag: str) -> Path:
    found = sorted(dist.glob(f"otel_specdec-*-{tag}.whl"))
    assert len(found) == 1, (tag, sorted(p.name for p in dist.iterdir()))
    return found[0]


def _extension(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".so")]
        assert names == ["otel_specdec/_rowscan.abi3.so"], names
        return Path(archive.extract(names[0], dest))


def test_every_artefact_is_built_with_its_tags(dist: Path) -> None:
    names = sorted(p.name for p in dist.iterdir())
    assert len(names) == 4, names
    assert len(list(dist.glob("otel_specdec-*.tar.gz"))) == 1
    for tag in ("py3-none-any", "cp310-abi3-manylinux2014_x86_64",
                "cp310-abi3-manylinux2014_aarch64"):
        _wheel(dist, tag)
    with zipfile.ZipFile(_wheel(dist, "py3-none-any")) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]
        assert "otel_specdec/_accounting.py" in archive.namelist()


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_binary_wheel_holds_a_c_pass_for_its_arch_on_glibc_2_17_and_abi3(
        dist: Path, arch: str, tmp_path: Path) -> None:
    wheel = _wheel(dist, f"cp310-abi3-manylinux2014_{arch}")
    so = _extension(wheel, tmp_path)
    header = so.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and header[4] == 2  # 64-bit ELF
    assert int.from_bytes(header[18:20], "little") == ELF_MACHINE[arch]
    versions = subprocess.run(["readelf", "--version-info", "--wide", str(so)],
                              capture_output=True, text=True, check=True).stdout
    needed = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9.]+)", versions)}
    assert needed and max(needed) <= GLIBC_MAX, sorted(needed)
    dynamic = subprocess.run(["readelf", "--dynamic", "--wide", str(so)],
                             capture_output=True, text=True, check=True).stdout
    libraries = set(re.findall(r"Shared library: \[([^\]]+)\]", dynamic))
    assert libraries <= {"libc.so.6"}, libraries
    audit = subprocess.run([str(DIST_VENV / "bin" / "abi3audit"), "--strict",
                            "--assume-minimum-abi3", "3.10", "--report", str(wheel)],
                           capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    [audited] = json.loads(audit.stdout)["specs"][str(wheel)]["wheel"]
    result = audited["result"]
    assert audited["name"] == "_rowscan.abi3.so"
    assert result["is_abi3"] and result["is_abi3_baseline_compatible"], result
    assert result["baseline"] == "3.10" and not result["non_abi3_symbols"], result


# Names of C compilers (and their drivers) kept off the venv's PATH.
_COMPILER = re.compile(r"^(cc|c89|c99|c\+\+|cpp|gcc|g\+\+|clang|clang\+\+|tcc|zig|icc)([-.0-9].*)?$"
                       r"|^.*-(gcc|g\+\+|cc|cpp|clang)([-.0-9].*)?$")


def _venv_without_compiler(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh venv that sees vLLM (the suite's venv, by a .pth) and a PATH of
    the machine's tools without any C compiler (vLLM's CPU build runs lscpu)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(_purelib(str(venv / "bin" / "python")))
    (site / "vllm_host.pth").write_text(f"{_purelib()}\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        for exe in Path(folder).iterdir() if Path(folder).is_dir() else ():
            if not _COMPILER.match(exe.name) and not (tools / exe.name).exists():
                (tools / exe.name).symlink_to(exe)
    path = os.pathsep.join([str(venv / "bin"), str(tools)])
    for compiler in ("cc", "gcc", "c99", "clang", "zig", "x86_64-linux-gnu-gcc"):
        assert shutil.which(compiler, path=path) is None, compiler
    assert shutil.which("lscpu", path=path)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "LDSHARED", "PYTHONPATH")}
    return venv, {**env, "PATH": path}


def _purelib(python: str = sys.executable) -> str:
    """A Python's site-packages (by default the suite's venv's)."""
    return subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()


def test_x86_64_wheel_installed_without_a_compiler_counts_a_real_engine_in_c(
        dist: Path, tiny_model: str, tmp_path: Path) -> None:
    venv, env = _venv_without_compiler(tmp_path)
    python = str(venv / "bin" / "python")
    wheel = _wheel(dist, "cp310-abi3-manylinux2014_x86_64")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--no-compile", "--disable-pip-version-check", str(wheel)],
        env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    where = subprocess.run([python, "-c", "import otel_specdec._rowscan as m; print(m.__file__)"],
                           env=env, capture_output=True, text=True, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    installed = Path(where.stdout.strip())
    assert installed.is_relative_to(venv) and installed.name == "_rowscan.abi3.so", installed

    with OtlpReceiver() as receiver:
        result = run_in_child(
            {"model": tiny_model, "speculative_config": NGRAM},
            with_child_site(clean_env(**{k: env[k] for k in ("PATH",)},
                                      OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint("grpc"),
                                      OTEL_EXPORTER_OTLP_PROTOCOL="grpc"),
                            SPECDEC_TEST_REPORT_PATHS="1"),
            python=python, timeout=420)
        store = receiver.store
    vllm = result["vllm"]
    assert vllm["drafts"] > 0
    assert store.spec_decode_totals() == vllm, shutdown_evidence(result, store)
    reports = [json.loads(line.split("accounting paths ", 1)[1])
               for line in result["stderr"].splitlines() if "accounting paths " in line]
    assert len(reports) == 1, shutdown_evidence(result, store)
    assert Path(reports[0]["c_pass"]) == installed
    steps = reports[0]["steps"]
    assert steps["native"] > 0, steps


def _arm64_root() -> Path:
    root = Path(os.environ.get("OTEL_SPECDEC_ARM64_ROOT", ROOT / ".arm64-python"))
    qemu = shutil.which("qemu-aarch64-static")
    if qemu is None or not (root / "usr" / "bin" / "python3.11").exists():
        message = (f"no arm64 Python under qemu ({root}): scripts/install-system-packages.sh "
                   "and scripts/arm64-python.sh")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return root


def test_aarch64_c_pass_gives_the_exact_paths_totals_under_qemu(dist: Path, tmp_path: Path) -> None:
    root = _arm64_root()
    wheel = _wheel(dist, "cp310-abi3-manylinux2014_aarch64")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "wheel")
    host_site = _purelib()
    # The wheel first; the pure-Python dependencies from the suite's venv
    # (their optional x86_64 extensions fail to load and are skipped).
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'wheel'}{os.pathsep}{host_site}"}
    proc = subprocess.run(
        ["qemu-aarch64-static", "-L", str(root), str(root / "usr" / "bin" / "python3.11"),
         str(REPLAY)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    replay = json.loads(proc.stdout)
    assert replay["machine"] == "aarch64"
    assert replay["c_pass"] == str(tmp_path / "wheel" / "otel_specdec" / "_rowscan.abi3.so")
    c_paths, exact_paths = replay["c"].pop("paths"), replay["exact"].pop("paths")
    assert c_paths["native"] > 0 and c_paths["exact"] == 0, c_paths
    assert exact_paths["native"] == 0 and exact_paths["exact"] > 0, exact_paths
    assert replay["c"] == replay["exact"]
    expected = replay["expected"]
    assert {k: replay["c"][k] for k in expected} == expected
    assert expected["drafts"] > 0
