"""Find a stage by its recipe name, importing its package only when a recipe uses it.

``tokenizer_ext.extend`` is the ``extend`` entry of ``tokenizer_ext.stages.STAGES``. Core
stages (``bootstrap``, ``import``, and ``serve.validate``, the one place the core drives the serve engine)
are listed here; ``serve`` itself never imports the core.
"""

from __future__ import annotations

import importlib

from warsha.stage import StageDef

STAGE_PACKAGES = ("tokenizer_ext", "context_ext", "distill", "quantize")
CORE_STAGES = {
    "bootstrap": "warsha.bootstrap",
    "import": "warsha.model_import.stage",
    "serve.validate": "warsha.serve_validate",
}


class UnknownStage(KeyError):
    """A recipe names a stage no package registers."""


def get_stage(name: str) -> StageDef:
    """The :class:`StageDef` registered under ``name``."""
    if name in CORE_STAGES:
        module = importlib.import_module(CORE_STAGES[name])
        return module.STAGE
    package, _, short = name.partition(".")
    if package not in STAGE_PACKAGES or not short:
        raise UnknownStage(name)
    stages = _package_stages(package)
    if short not in stages:
        raise UnknownStage(name)
    return stages[short]


def _package_stages(package: str) -> dict[str, StageDef]:
    try:
        module = importlib.import_module(f"{package}.stages")
    except ModuleNotFoundError as exc:
        if exc.name == f"{package}.stages":
            return {}
        raise
    return dict(getattr(module, "STAGES", {}))


def known_stages() -> list[str]:
    """Every registered stage name (imports each package's light ``stages`` module)."""
    names = [n for n in CORE_STAGES if _core_available(n)]
    for package in STAGE_PACKAGES:
        names += [d.name for d in _package_stages(package).values()]
    return names


def _core_available(name: str) -> bool:
    try:
        importlib.import_module(CORE_STAGES[name])
    except ModuleNotFoundError:
        return False
    return True
