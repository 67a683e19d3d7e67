"""The README's API example runs as written (extracted from README.md, so the two cannot drift)."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_api_block() -> str:
    """The ```python block of README.md's "The API" section."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    section = readme.split("\n## The API\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return block


def test_readme_api_example_runs(megatron_world, capsys):
    namespace = {"__name__": "readme"}
    exec(compile(readme_api_block(), "README.md", "exec"), namespace)  # pylint: disable=exec-used
    plan, per_sequence = namespace["plan"], namespace["per_sequence"]
    assert plan.executed_tokens < plan.logical_tokens
    assert [len(loss) for loss in per_sequence] == [len(s) for s in namespace["sequences"]]
    assert namespace["model"].embedding.word_embeddings.weight.grad is not None  # backward ran
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "30 tokens computed as 16 in 1 row(s)" and printed[1].startswith("[")


def test_documents_cite_only_files_of_the_repository():
    """Every ``*.md`` file that the docs, code and tests cite exists here (the docs stand alone)."""
    cited = re.compile(r"(?<![\w./-])([\w./-]*[A-Za-z]\w*\.md)\b")
    roots = ["README.md", "CONTRIBUTING.md", "pretrain_hybrid.py"]
    for folder in ("docs", "megatron", "tests", "tools"):
        for base, _, names in os.walk(os.path.join(REPO, folder)):
            roots += [os.path.join(base, n) for n in names if n.endswith((".md", ".py"))]
    missing = []
    for path in roots:
        path = os.path.join(REPO, path)
        with open(path, encoding="utf-8") as handle:
            for name in set(cited.findall(handle.read())):
                places = (REPO, os.path.dirname(path), os.path.join(REPO, "docs"))
                if not any(os.path.isfile(os.path.join(place, name)) for place in places):
                    missing.append(f"{os.path.relpath(path, REPO)} cites {name}")
    assert not missing, missing
