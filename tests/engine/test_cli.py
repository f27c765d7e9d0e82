"""`mixserve generate`: a completion then its timings; a bad file or flag is exit code 2 and one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def generate(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mixserve", "generate", *argv],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prefill-chunk", "-3"], "engine.prefill_chunk: must be >= 0"),
        (["--prefill-chunk", "abc"], "--prefill-chunk: must be an integer"),
        (["--dtype", "fp8"], "engine.dtype: must be one of"),
        (["--config", "{bad}"], "engine.bogus: unknown key"),
        (["--config", "/no/such/runtime.toml"], "config file not found"),
        (["--temperature", "-1"], "temperature: must be >= 0"),
    ],
)
def test_bad_flag_or_file_exits_2_with_one_line(tmp_path: Path, argv: list[str], needle: str) -> None:
    bad = tmp_path / "runtime.toml"
    bad.write_text("[engine]\nbogus = 1\n")
    proc = generate("--prompt", "hi", *[a.replace("{bad}", str(bad)) for a in argv])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_generate_prints_the_completion_then_timings(tiny_model_dir: Path) -> None:
    proc = generate("--prompt", "the cat", "--model", str(tiny_model_dir), "--max-tokens", "5",
                    "--threads", "1", "--num-blocks", "16")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("TTFT ") and "TPOT " in last and "tokens/s (5 tokens)" in last
