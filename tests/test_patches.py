"""The patch registry (``otel_specdec._patches``) lists exactly the vLLM
methods the plugin patches, as installed on the running vLLM."""

from __future__ import annotations

import importlib

from wrapt import FunctionWrapper

from otel_specdec import _patches


def _patched_methods(cls: type) -> set[str]:
    """Methods of ``cls`` replaced by the plugin: a wrapt wrapper, or its step hook."""
    return {
        name for name, value in vars(cls).items()
        if isinstance(value, FunctionWrapper) or getattr(value, "_otel_specdec_hook", False)
    }


def _listed_vllm_methods() -> dict[str, set[str]]:
    """class path -> methods the registry names, for its vLLM targets."""
    listed: dict[str, set[str]] = {}
    for patch in _patches.PATCHES:
        if not patch.target.startswith("vllm."):
            continue
        first, *more = (t.strip() for t in patch.target.split(","))
        cls_path, method = first.rsplit(".", 1)
        listed.setdefault(cls_path, set()).update([method, *(m.lstrip(".") for m in more)])
    return listed


def test_registry_names_every_vllm_patch_installed(reader):
    listed = _listed_vllm_methods()
    assert listed  # the registry has vLLM targets at all
    for cls_path, methods in listed.items():
        module, name = cls_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        assert _patched_methods(cls) == methods, cls_path


def test_each_entry_is_complete_and_its_module_exists():
    for patch in _patches.PATCHES:
        assert all((patch.target, patch.why, patch.how, patch.watch, patch.removable_when))
        importlib.import_module(patch.module)
