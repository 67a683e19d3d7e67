"""tools/bench_attention.py: the grouped-query run writes a section of its own."""

import torch


def test_grouped_query_run_has_its_own_section(monkeypatch, load_tool):
    """``--query-groups`` below ``--heads`` must not replace the main table's section."""
    tool = load_tool("bench_attention")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "GPU")
    row = {"forest": "star", "tree ms": 1.0}
    plain = tool.markdown([row], "python tools/bench_attention.py")
    assert plain.startswith(f"## {tool.SECTION}\n") and "key/value heads" not in plain
    assert tool.markdown([row], "cmd", heads=32, groups=32) == plain.replace(
        "python tools/bench_attention.py", "cmd"
    )
    grouped = tool.markdown([row], "cmd", heads=32, groups=8)
    assert grouped.startswith(f"## {tool.GROUPED_SECTION}\n")
    assert "32 query heads over 8 key/value heads" in grouped
    assert tool.SECTION != tool.GROUPED_SECTION
