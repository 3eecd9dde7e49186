"""The README's library example runs as written (CPU, one process, small shapes).

Every ```python block that directly follows a ``<!-- readme-snippet: test -->`` line in README.md is
executed unchanged, in README order, in one fresh namespace (a later block may continue an earlier
one, as the README's FP8 example continues the library example).
"""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- readme-snippet: test -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\s*\n```python\n(.*?)\n```", re.DOTALL)


def marked_blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def test_readme_has_a_marked_snippet():
    text = README.read_text()
    blocks = marked_blocks(text)
    assert blocks, f"README.md has no ```python block after {MARKER!r}"
    # every marker must be followed by a python block (a marker left behind would test nothing)
    assert len(blocks) == text.count(MARKER)


def test_readme_snippets_run_as_written():
    torch = pytest.importorskip("torch")
    import megatron_mok as mok

    namespace = {"__name__": "__readme__"}
    mok.clear_workspace_cache()
    torch.manual_seed(0)
    try:
        for index, code in enumerate(marked_blocks(README.read_text())):
            exec(compile(code, f"README.md (snippet {index})", "exec"), namespace)
    finally:
        mok.clear_workspace_cache()


def test_readme_results_markers():
    """The generated results table sits between exactly one pair of markers, in order."""
    text = README.read_text()
    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    assert text.index(begin) < text.index(end)
