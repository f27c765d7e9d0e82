"""Importing the configuration does not import jsonschema: runner-only machines may lack it."""

from __future__ import annotations

import subprocess
import sys


def test_config_import_leaves_jsonschema_out() -> None:
    code = "import sys, mixserve.config; print('jsonschema' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
