"""DFlash Lab: a package per stage, on the data's way: data -> plan -> models -> train -> evaluate,
regenerate; lab (notebooks, demo) on top; the target families, config and rundir at the bottom. A lower stage never
imports a higher one (tests/test_layering.py)."""

__version__ = '0.1.0'
