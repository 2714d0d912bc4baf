"""The README's supported-versions table says what the project tests: each row agrees with
ckpt_offload/versions.py (the one list the build, the metadata and the import check read)
and with the locks CI installs (the project venv, the newest-torch venv, the Axolotl venv)."""

import os

import pytest
from packaging.requirements import Requirement

from ckpt_offload import versions

LOCKS = {
    "lock": "requirements/lock.txt",
    "newest": "requirements/newest-lock.txt",
    "axolotl": "requirements/axolotl-lock.txt",
}


def root():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(here))


def read(path):
    with open(os.path.join(root(), path)) as f:
        return f.read()


def pins(path):
    found = {}
    for line in read(path).splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            found[name.lower().replace("_", "-")] = version
    return found


def table(column=1):
    """{package: its cell in `column`} from the README's Versions table (1: tested,
    2: where)."""
    text = read("README.md")
    section = text[text.index("## Versions"):]
    section = section[:section.index("\n## ", 4)] if "\n## " in section[4:] else section
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= set("-"):
            rows[cells[0]] = cells[column]
    return rows


def test_torch_and_python_rows_are_the_tested_lists():
    rows = table()
    assert rows["torch"] == ", ".join(versions.TORCH_MINORS)
    assert rows["Python"] == ", ".join(versions.PYTHON_MINORS)


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_lock_has_a_tested_torch(lock):
    torch_pin = pins(LOCKS[lock])["torch"]
    assert versions.torch_minor(torch_pin) in versions.TORCH_MINORS, (lock, torch_pin)


def test_ci_covers_the_oldest_and_the_newest_tested_torch():
    assert versions.torch_minor(pins(LOCKS["lock"])["torch"]) == versions.TORCH_MINORS[0]
    assert versions.torch_minor(pins(LOCKS["newest"])["torch"]) == versions.TORCH_MINORS[-1]


@pytest.mark.parametrize("extra,package", [
    (extra, Requirement(spec).name) for extra, specs in versions.EXTRAS.items() for spec in specs])
def test_extras_rows_show_the_bounds_and_every_locked_release_within_them(extra, package):
    text = next(s for s in versions.EXTRAS[extra] if Requirement(s).name == package)
    spec = Requirement(text)
    cell, where = table()[package], table(column=2)[package]
    assert cell.startswith(text[len(package):]) and f"`[{extra}]`" in cell, (package, cell)
    locked = {lock: pins(path)[package] for lock, path in LOCKS.items() if package in pins(path)}
    assert locked, f"no lock pins {package}"
    for lock, version in locked.items():
        assert spec.specifier.contains(version), (lock, package, version, str(spec))
        assert version in where, f"README's {package} row does not name {version} ({lock})"



def test_install_block_asks_for_the_tested_torch_range():
    assert f'pip install "{versions.torch_requirement()}"' in read("README.md")
