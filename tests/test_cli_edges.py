"""`lingbot-run` and `python -m lingbot_core` rough edges: flags that would be ignored, noisy progress,
late failures, signals and messages (each found by running the commands as a user would)."""

from __future__ import annotations

import pytest

from lingbot_nodes.cli import main


@pytest.fixture
def no_model_work(monkeypatch):
    """Any model work fails the test: what is checked here must be refused before it."""
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    def must_not_run(*_a, **_k):
        raise AssertionError("the loader ran")

    for name in ("LingBotLoader", "LingBotLoaderFiles"):
        monkeypatch.setattr(NODE_CLASS_MAPPINGS[name], "execute", must_not_run)


def _last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


@pytest.mark.parametrize("flag,value", [("--rewrite-endpoint", "http://127.0.0.1:9/v1"), ("--rewrite-model", "m"),
                                        ("--rewrite-map-model", "m"), ("--rewrite-duration", "3")])
def test_rewrite_settings_without_rewrite_are_refused(tmp_path, capsys, no_model_work, flag, value):
    assert main(["t2v", flag, value, "--output", str(tmp_path)]) == 2
    line = _last_error(capsys)
    assert line.startswith("error: ") and flag in line and "--rewrite \"" in line, line


def test_rewrite_settings_fill_a_rewrite_workflows_node_without_rewrite():
    from lingbot_core.workflow import load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import insert_rewrite, resolve_workflow

    prompt = load_workflow(resolve_workflow("t2v-rewrite"), NODE_CLASS_MAPPINGS)
    saved = {nid: dict(n["inputs"]) for nid, n in prompt.nodes.items() if n["class_type"] == "LingBotRewrite"}
    before = set(prompt.nodes)
    prompt = insert_rewrite(prompt, None, endpoint="http://127.0.0.1:9/v1", model="expand-m")
    assert set(prompt.nodes) == before and saved
    for nid, inputs in saved.items():
        now = prompt.nodes[nid]["inputs"]
        assert now["prompt"] == inputs["prompt"] and now["endpoint"] == "http://127.0.0.1:9/v1"
        assert now["expand_model"] == "expand-m"
