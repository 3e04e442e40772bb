"""Drafter kinds (`-p drafter_kind NAME`), one module each declaring a `DrafterKind` (kind.py): `dflash`
(dflash.py), `dflash2` (dflash2.py). `drafter_kind(name)` finds one by its setting, `kind_of_folder(doc, where)` by
a serving folder's architectures, `kind_of_drafter(module)` by its module. How to add a kind: docs/architecture.md, "How to add a drafter kind".
"""

from __future__ import annotations

from typing import Any

from dflash_lib.config import ConfigError
from dflash_lib.models.drafters import dflash, dflash2
from dflash_lib.models.drafters.kind import DrafterKind

__all__ = ["KINDS", "DrafterKind", "drafter_kind", "kind_of_drafter", "kind_of_folder", "registry"]


def registry(*kinds: DrafterKind) -> dict[str, DrafterKind]:
    """{name: kind}, refusing two kinds that share a name, an architecture or a module class: a folder's kind is
    found by its architecture, a drafter's by its class (a kind that reuses another's module subclasses it)."""
    for what, keys in (("name", [k.name for k in kinds]), ("architecture", [a for k in kinds for a in k.architectures]),
                       ("module class", [f"{k.module_class.__module__}.{k.module_class.__qualname__}" for k in kinds])):
        doubled = sorted({key for key in keys if keys.count(key) > 1})
        if doubled:
            raise ConfigError(f"models/drafters: two drafter kinds share the {what} {doubled[0]!r}")
    return {k.name: k for k in kinds}


KINDS: dict[str, DrafterKind] = registry(dflash.KIND, dflash2.KIND)  # by name: ModelConfig.drafter_kind's values


def drafter_kind(name: str) -> DrafterKind:
    """The kind the drafter_kind setting `name` names; ConfigError listing the kinds for another."""
    if name not in KINDS:
        raise ConfigError(f"drafter_kind {name!r} is not a drafter kind here (one of {sorted(KINDS)})")
    return KINDS[name]


def kind_of_folder(doc: dict[str, Any], where: str) -> DrafterKind:
    """The kind whose architecture a serving config.json `doc` (read from `where`) names first; ConfigError
    naming `where` when it names none."""
    names = doc.get("architectures")
    for name in names if isinstance(names, list) else []:
        for kind in KINDS.values():
            if name in kind.architectures:
                return kind
    known = [a for k in KINDS.values() for a in k.architectures]
    raise ConfigError(f"{where}: architectures {names!r} names no drafter kind here (one of {known})")


def kind_of_drafter(module: Any) -> DrafterKind:
    """The kind whose module class `module` is (exactly: a subclass may be another kind)."""
    for kind in KINDS.values():
        if type(module) is kind.module_class:
            return kind
    raise ConfigError(f"{type(module).__name__} is no drafter kind's module (the kinds: {sorted(KINDS)})")
