"""docs/CELERY.md's ported app, run as a newcomer would: its two files written out as the
guide shows them, a worker and a dispatcher started on the app (`-A shop_port`), then
`python producer.py`, whose output must be what the guide's comment says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def guide_files() -> dict[str, str]:
    """The guide's Python blocks that start with a `# <file>.py` line, by file name."""
    text = (ROOT / "docs" / "CELERY.md").read_text()
    blocks = re.findall(r"```python\n# (\w+\.py)\n(.*?)```", text, re.S)
    return {name: body for name, body in blocks}


def test_the_ported_app_runs_as_the_guide_says(stack, tmp_path):
    files = guide_files()
    assert set(files) >= {"shop_port.py", "producer.py"}, sorted(files)
    for name in ("shop_port.py", "producer.py"):
        (tmp_path / name).write_text(files[name])
    said = re.search(r"^print\(.*\)\s+# (.+)$", files["producer.py"], re.M)
    assert said, "producer.py's print line says what it prints"
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    stack.worker(app="shop_port", env=env)
    stack.dispatcher(app="shop_port", env=env)  # promotes the retried (delayed) settle
    r = subprocess.run([sys.executable, "producer.py"], cwd=tmp_path, env={**stack.env, **env},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == said.group(1)
