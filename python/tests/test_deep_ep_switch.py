"""`import deep_ep` resolving to ferry.deep_ep with no change to an engine's code: FERRY_DEEP_EP=1 with the wheel's
ferry-deep-ep.pth (emulated here by a site directory holding that file, as an installed wheel has it), or
ferry.deep_ep.install(). Each case runs in a fresh interpreter (the switch acts on its import system).

Checked: the modules and names engines and DeepEP's own tests import resolve to Ferry's (one module object under
both names); without the variable the .pth imports neither ferry nor torch; a deep_ep imported before install() is
refused with a message saying what to do. Made to fail once on purpose: the .pth's activation reading the variable
as set when it is "0" failed test_unset_variable_costs_nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="ferry.deep_ep needs torch")

import ferry  # noqa: E402

PTH = Path(__file__).resolve().parents[1] / "ferry-deep-ep.pth"


def _python(code: str, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """code in a fresh interpreter whose site directories include one holding ferry-deep-ep.pth (as pip installs it
    into site-packages), with ferry importable from this test's path."""
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / PTH.name).write_text(PTH.read_text())
    boot = f"import site; site.addsitedir({str(site_dir)!r})\n"
    full_env = dict(os.environ)
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run([sys.executable, "-c", boot + code], env=full_env, capture_output=True, text=True,
                          timeout=120)


def test_pth_is_one_cheap_line():
    lines = [line for line in PTH.read_text().splitlines() if line.strip()]
    assert lines == ["import _ferry_deep_ep; _ferry_deep_ep.activate_from_env()"]


def test_environment_variable_switches_every_module(tmp_path):
    code = """
import sys
import deep_ep
import deep_ep.buffer, deep_ep.buffers.legacy, deep_ep.buffers.elastic, deep_ep.utils.envs
from deep_ep import Buffer, Config, ElasticBuffer, EPHandle, EventOverlap, EventHandle, topk_idx_t
from deep_ep.utils import EventOverlap as E2, EventHandle as H2
from deep_ep.utils.event import EventOverlap as E3
import ferry.deep_ep as fd
assert deep_ep is fd and sys.modules["deep_ep.utils"] is sys.modules["ferry.deep_ep.utils"]
assert deep_ep.__spec__.name == "ferry.deep_ep", deep_ep.__spec__
assert Buffer is fd.Buffer is deep_ep.buffer.Buffer is deep_ep.buffers.legacy.Buffer
assert ElasticBuffer is fd.ElasticBuffer is deep_ep.buffers.elastic.ElasticBuffer
assert E2 is E3 is EventOverlap is fd.EventOverlap and H2 is EventHandle
assert deep_ep.utils.envs.get_logical_domain_size.__module__ == "ferry.deep_ep.utils.envs"
try:
    import deep_ep.not_a_module
except ModuleNotFoundError as error:
    assert "deep_ep.not_a_module" in str(error), error
else:
    raise AssertionError("a module ferry.deep_ep does not have was found")
print("switched")
"""
    got = _python(code, {"FERRY_DEEP_EP": "1"}, tmp_path)
    assert got.returncode == 0 and "switched" in got.stdout, got.stderr


def test_unset_variable_costs_nothing(tmp_path):
    code = """
import sys
import _ferry_deep_ep
assert not _ferry_deep_ep.installed()
assert "ferry" not in sys.modules and "torch" not in sys.modules, sorted(m for m in sys.modules if "ferry" in m)
try:
    import deep_ep
except ModuleNotFoundError:
    print("untouched")
else:
    print("a real deep_ep is installed here:", deep_ep.__file__)
"""
    for value in ("", "0"):  # unset or off (the environment of this test may set it: it is overridden)
        got = _python(code, {"FERRY_DEEP_EP": value}, tmp_path)
        assert got.returncode == 0 and ("untouched" in got.stdout or "real deep_ep" in got.stdout), got.stderr


def test_install_call_and_an_earlier_deep_ep(tmp_path):
    code = """
import sys, types
import ferry.deep_ep as fd
assert not fd.installed()
fd.install()
import deep_ep
assert deep_ep is fd and fd.installed()
fd.uninstall()
del sys.modules["deep_ep"]
sys.modules["deep_ep"] = types.ModuleType("deep_ep")  # an engine imported another deep_ep first
try:
    fd.install()
except RuntimeError as error:
    assert "already imported" in str(error) and "FERRY_DEEP_EP=1" in str(error), error
    print("refused")
"""
    got = _python(code, {"FERRY_DEEP_EP": ""}, tmp_path)
    assert got.returncode == 0 and "refused" in got.stdout, got.stderr
