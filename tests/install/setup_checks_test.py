"""setup.py's checks before it compiles anything: a setuptools that cannot build a wheel (a
fresh Python 3.11 venv's), no importable torch (pip's build isolation hides it), and a torch
that build isolation brought in instead of the user's. Each stops with the command to run."""

import subprocess
import sys
import types

import pytest

from setup_loader import copy_build_files, load_setup

setup = load_setup()


def test_old_setuptools_without_wheel_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(setup.setuptools, "__version__", "65.5.0")
    monkeypatch.setattr(setup.importlib_util, "find_spec", lambda name: None)
    message = setup.check_wheel_support(["bdist_wheel", "-d", "/tmp/x"])
    assert "setuptools 65.5.0 cannot build a wheel" in message
    assert "pip install 'setuptools>=70.1'" in message
    assert "pip install --no-build-isolation ." in message
    assert setup.check_wheel_support(["build_ext", "--inplace"]) is None
    monkeypatch.setattr(setup.setuptools, "__version__", "70.1.0")
    assert setup.check_wheel_support(["bdist_wheel"]) is None


def test_fresh_python_venv_stops_with_the_setuptools_command(tmp_path):
    """pip and setuptools as `python3.11 -m venv` installs them (no wheel package)."""
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)],
                   check=True)
    python = str(venv / "bin" / "python")
    have = subprocess.run([python, "-c", "import setuptools; print(setuptools.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if tuple(int(p) for p in have.split(".")[:2]) >= setup.SETUPTOOLS_FOR_WHEELS:
        pytest.skip(f"this Python's venv brings setuptools {have}, which builds wheels")
    src = tmp_path / "src"
    copy_build_files(src)
    result = subprocess.run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                             "--no-index", "-w", str(tmp_path / "wheels"), str(src)],
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"setuptools {have} cannot build a wheel" in output, output
    assert "pip install 'setuptools>=70.1'" in output
    assert "invalid command 'bdist_wheel'" not in output


def test_missing_torch_says_install_it_and_turn_isolation_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as stop:
        setup.import_torch({})
    message = str(stop.value)
    assert message.startswith("ckpt_offload build: torch is not importable here.")
    assert "pip install 'torch>=" in message and "--no-build-isolation" in message


def fake_torch(version, path):
    return types.SimpleNamespace(__version__=version, __file__=path)


def test_torch_from_build_isolation_names_both_torches(monkeypatch):
    isolated = "/tmp/pip-build-env-abc/overlay/lib/python3.12/site-packages/torch/__init__.py"
    monkeypatch.setitem(sys.modules, "torch", fake_torch("2.15.0+cu132", isolated))
    monkeypatch.setattr(setup, "_torch_outside_build_env",
                        lambda env: ("2.11.0+cu130", "/venv/lib/python3.11/site-packages/torch"))
    with pytest.raises(SystemExit) as stop:
        setup.import_torch({})
    message = str(stop.value)
    assert "build isolation brought torch 2.15.0+cu132" in message
    assert "this environment imports torch 2.11.0+cu130" in message
    assert message.endswith("pip install --no-build-isolation .")


def test_untested_torch_stops_the_build_unless_allowed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch("2.99.0", "/venv/torch/__init__.py"))
    with pytest.raises(SystemExit) as stop:
        setup.import_torch({})
    assert str(stop.value).startswith("ckpt_offload build: found torch 2.99.0; tested")
    allowed = setup.import_torch({setup.VERSIONS.ALLOW_UNTESTED_TORCH_ENV: "1"})
    assert allowed.__version__ == "2.99.0"
