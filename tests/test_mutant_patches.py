"""The planted bugs of `make mutate` (`tests/mutants/*.patch`) still apply to the code: a patch
whose context moved away is a mutant the harness is no longer asked about (`run.py` reports it
as "patch failed", and only when someone runs it)."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = sorted(glob.glob(os.path.join(ROOT, "tests", "mutants", "*.patch")))


def test_there_are_mutants():
    assert len(PATCHES) >= 18


@pytest.mark.parametrize("patch", PATCHES, ids=os.path.basename)
def test_a_mutant_applies_to_the_code_as_it_is(patch):
    first = open(patch).readline()
    assert first.startswith("# ") and ":" in first, "the first line says which component and what bug"
    p = subprocess.run(["git", "apply", "--check", patch], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, f"{os.path.basename(patch)} no longer applies: regenerate it " \
                              f"(tests/mutants/run.py docstring)\n{p.stderr}"
