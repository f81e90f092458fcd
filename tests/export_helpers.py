"""Running a script in a fresh interpreter, for the `trust_remote_code` export tests: lazoo importable but never
imported ("clean"), or made unimportable ("hidden"), with only the environment transformers needs offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

#: the opening of every script: argv[1] is the mode; in "hidden" mode lazoo cannot be imported
HIDE_LAZOO = textwrap.dedent('''
    import json, sys
    if sys.argv[1] == "hidden":
        import importlib.abc

        class HideLazoo(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "lazoo" or name.startswith("lazoo."):
                    raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
                return None

        sys.meta_path.insert(0, HideLazoo())
        try:
            import lazoo  # noqa: F401
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("lazoo is still importable")
''')

#: the end of every script: which lazoo modules were imported, the transformers version, the results as JSON
REPORT = textwrap.dedent('''
    results["lazoo_imported"] = sorted(m for m in sys.modules if m == "lazoo" or m.startswith("lazoo."))
    import transformers
    results["transformers"] = transformers.__version__
    print("RESULT" + json.dumps(results))
''')

#: another virtualenv's python (scripts/test_range.sh sets it to the other end of the supported range)
OTHER_PYTHON = os.environ.get("LAZOO_OTHER_PYTHON")


def run_script(body: str, mode: str, args: list[str], tmp_path, python: str = sys.executable) -> dict:
    """Run `HIDE_LAZOO + body + REPORT` (`body` fills the dict `results`) as `python -c SCRIPT mode *args` in
    `tmp_path`, offline, with its own transformers module cache; returns `results`."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"), PYTHONNOUSERSITE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    script = HIDE_LAZOO + textwrap.dedent(body) + REPORT
    proc = subprocess.run([python, "-c", script, mode, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])
