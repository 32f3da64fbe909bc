"""How the daemon starts one of its own modules in a child process (`python -m MODULE`).

A child that runs a sitsd module must import the package from where its parent did, however
the parent was started (an installed `sitsd` script, `python -m`, pytest's rootdir on the
path, a device's `PYTHONPATH`): it gets the parent's interpreter and the parent's `sys.path`
as its `PYTHONPATH`. The callers (`sitsd.runtime.precompile`, `sitsd.weights.hash_child`) own
what the child does and how it talks back.
"""

from __future__ import annotations

import os
import sys


def module_command(module: str, **env: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run `python -m module` with this process's import path;
    `env`: variables set on top of this process's environment."""
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return [sys.executable, "-m", module], child_env
