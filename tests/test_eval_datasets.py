import json

import pytest

from trtkv.eval import datasets as D


@pytest.fixture
def no_defaults(monkeypatch, tmp_path):
    """No env var, and an empty sibling dir: only the packaged subsets remain."""
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    monkeypatch.setattr(D, "SIBLING_DATA_DIR", tmp_path / "no-such-dir")
    return tmp_path


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_packaged_subsets(no_defaults):
    assert D.resolve_data_file("calibration") == D.PACKAGE_DATA_DIR / "calibration_prompts.jsonl"
    cal = D.load_problems("calibration")
    assert len(cal) == 100 and cal[0].id == "amc23-0" and cal[0].answer == "27"
    traces = D.load_traces()
    assert len(traces) == 4
    for t in traces:
        assert t.prompt.endswith("<think>\n") and 1000 < len(t.completion) <= 6000
        assert t.model.startswith("deepseek-ai/") and t.gt_answer and t.question
    size = sum(p.stat().st_size for p in D.PACKAGE_DATA_DIR.iterdir())
    assert size < 200_000


def test_missing_file_message(no_defaults):
    with pytest.raises(D.DataFileNotFoundError) as ei:
        D.load_problems("gsm8k")
    assert isinstance(ei.value, FileNotFoundError)
    msg = str(ei.value)
    assert "gsm8k_test.jsonl" in msg and "--data FILE" in msg and D.ENV_VAR in msg
    with pytest.raises(D.DataFileNotFoundError, match="explicit path"):
        D.resolve_data_file("calibration", no_defaults / "nope.jsonl")
    with pytest.raises(ValueError, match="unknown task"):
        D.resolve_data_file("gsm9k")


def test_resolution_order(no_defaults, monkeypatch):
    tmp = no_defaults
    rec = [{"id": "x-1", "source": "s", "question": "q?", "answer": "7"}]
    sib = _write(tmp / "sib" / "calibration_prompts.jsonl", rec)
    env = _write(tmp / "env" / "calibration_prompts.jsonl", rec)
    expl = _write(tmp / "mine.jsonl", rec)
    monkeypatch.setattr(D, "SIBLING_DATA_DIR", tmp / "sib")
    assert D.resolve_data_file("calibration") == sib          # sibling beats packaged
    monkeypatch.setenv(D.ENV_VAR, str(tmp / "env"))
    assert D.resolve_data_file("calibration") == env          # env beats sibling
    assert D.resolve_data_file("calibration", expl) == expl   # explicit beats env
    assert D.resolve_data_file("calibration", tmp / "env") == env  # a dir works too
    # an explicitly configured dir without the file is an error, not a silent fallback
    monkeypatch.setenv(D.ENV_VAR, str(tmp / "empty"))
    with pytest.raises(D.DataFileNotFoundError, match=D.ENV_VAR):
        D.resolve_data_file("calibration")


def test_loaders_on_each_layout(tmp_path):
    _write(tmp_path / "gsm8k_test.jsonl", [{"question": "q", "answer": "x\n#### 1,000"}])
    _write(tmp_path / "math500_test.jsonl", [{"problem": "p", "solution": "s", "answer": r"\frac12",
                                              "subject": "A", "level": 1, "unique_id": "test/a/1.json"}])
    _write(tmp_path / "aime24_test.jsonl", [{"id": 67, "problem": "p", "answer": "025"}])
    _write(tmp_path / "aime25_test.jsonl", [{"id": "0", "problem": "p", "answer": 70}])
    assert D.load_problems("gsm8k", tmp_path)[0] == D.Problem("gsm8k-0", "q", "x\n#### 1,000", "gsm8k")
    assert D.load_problems("math500", tmp_path)[0].id == "test/a/1.json"
    assert D.load_problems("aime24", tmp_path)[0] == D.Problem("aime24-67", "p", "025", "aime24")
    assert D.load_problems("aime25", tmp_path)[0].answer == "70"
    areal = _write(tmp_path / "areal.jsonl", [{
        "run": "r", "task_id": "3", "sample_idx": "1", "model": "m", "prompt": "P",
        "completion": "<think>C", "question": "q", "gt_answer": None}])
    assert D.load_traces(areal) == [D.Trace("r/3/1", "m", "P", "<think>C", "q", None)]
    assert len(D.load_task("traces_areal", areal)) == 1
    with pytest.raises(ValueError):
        D.load_problems("traces", tmp_path)


def test_shared_data_when_present(monkeypatch):
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    if not D.SIBLING_DATA_DIR.is_dir():
        pytest.skip("no shared data dir next to the checkout")
    counts = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "calibration": 100}
    for task, n in counts.items():
        probs = D.load_problems(task)
        assert len(probs) == n and len({p.id for p in probs}) == n
    traces = D.load_task("traces")
    assert len(traces) == 32 and all("</think>" in t.completion for t in traces)
    areal = D.load_traces(task="traces_areal", limit=3)
    assert len(areal) == 3 and areal[0].completion.startswith("<think>")
