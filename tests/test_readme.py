"""The README's quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs_and_expands_routes():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    batch, per_layer = scope["batch"], scope["per_layer"]
    assert batch["routed_experts"].total_rows == 21
    assert batch["routed_experts_valid"].values.sum() == 19  # the last token of each has no row
    assert len(per_layer) == 48
    assert all(t.shape[1] == 8 for t in per_layer)


def test_every_link_of_the_readme_names_a_file_of_the_checkout():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert {"docs/architecture.md", "docs/loader.md", "docs/benchmarks.md"} <= set(local)
    assert len([link for link in local if link.startswith("notebooks/")]) == 4
    missing = [link for link in local if not (README.parent / link).is_file()]
    assert not missing
