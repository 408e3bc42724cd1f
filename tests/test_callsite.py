"""backfuse's warnings never stop the user's work, wherever the user works: a script, the REPL,
`python -c`, stdin, a notebook cell (IPython's run_cell, as Jupyter runs it), each in a fresh process;
they point at the user's line and show its text where there is one."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT

# A warning raised inside backfuse (nn.py), several frames below the user's line 2.
CODE = "from backfuse import nn\nnn.QkvGqa.from_state_dict({}, strict=False)\nprint('survived')\n"
WARNING = ": BackfuseWarning: QkvGqa.from_state_dict (strict=False): missing key(s) for 'q_weight'"
SOURCE_LINE = "  nn.QkvGqa.from_state_dict({}, strict=False)"
# A notebook whose cells run in the process's own __main__ (a kernel started from `python -c`, an embedded
# shell): the namespace whose loader once made warnings raise ImportError.
CELL_IN_MAIN = ("import IPython\nIPython.start_ipython(argv=['--quick', '--no-banner', '--colors=nocolor', '-c', {code!r}], "
                "user_ns=globals())\n")


def _run(argv, stdin=None, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    return subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.mark.parametrize("form", ["script", "python -c", "stdin", "REPL", "notebook cell", "notebook cell in __main__"])
def test_warnings_point_at_the_users_line_in_every_form(tmp_path, form):
    if form.startswith("notebook"):
        pytest.importorskip("IPython")
    script = tmp_path / "user_script.py"
    script.write_text(CODE)
    argv, stdin, site, shows_source = {
        "script": ([str(script)], None, f"{script}:2", True),
        "python -c": (["-c", CODE], None, "<string>:2", False),
        "stdin": (["-"], CODE, "<stdin>:2", False),
        "REPL": (["-i", "-q"], CODE, "<stdin>:1", False),  # the interactive loop compiles each statement alone
        "notebook cell": (["-m", "IPython", "--quick", "--no-banner", "--colors=nocolor", "-c", CODE], None,
                          "<ipython-input-1-", True),
        "notebook cell in __main__": (["-c", CELL_IN_MAIN.format(code=CODE)], None, "<ipython-input-1-", True),
    }[form]
    r = _run(argv, stdin, cwd=tmp_path)
    assert r.returncode == 0 and "survived" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "ImportError" not in r.stderr + r.stdout
    lines = r.stderr.splitlines()
    at = [i for i, line in enumerate(lines) if WARNING in line]
    assert len(at) == 1 and site in lines[at[0]].split(WARNING)[0], r.stderr
    assert (at[0] + 1 < len(lines) and lines[at[0] + 1] == SOURCE_LINE) is shows_source, r.stderr


SUITE_POLICY = '''
import warnings

from backfuse import nn


def test_a_backfuse_warning_at_the_users_line():
    nn.QkvGqa.from_state_dict({}, strict=False)


def test_a_warning_issued_from_a_backfuse_module():
    warnings.warn_explicit("as kernels/launch.py warns", RuntimeWarning, "launch.py", 1, module="backfuse.kernels.launch")


def test_a_warning_from_elsewhere():
    warnings.warn_explicit("not backfuse's", RuntimeWarning, "other.py", 1, module="other")
'''


def test_the_suite_fails_a_test_on_any_warning_from_backfuse(tmp_path):
    """pyproject's filters: backfuse's category, or any warning issued from its modules, fails the test."""
    (tmp_path / "test_policy.py").write_text(SUITE_POLICY)
    r = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"), str(tmp_path)])
    assert r.returncode == 1 and "2 failed, 1 passed" in r.stdout, r.stdout
    failed = {line.split("::")[-1].split()[0] for line in r.stdout.splitlines() if line.startswith("FAILED ")}
    assert failed == {"test_a_backfuse_warning_at_the_users_line", "test_a_warning_issued_from_a_backfuse_module"}
