"""`pagedserve run-batch`: a batch file run offline through the server's handlers, the
answers in the output files' line format, in input order."""
from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.cli import main


@pytest.mark.slow
def test_run_batch_writes_one_answer_line_per_input_line(tmp_path, capsys):
    requests = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "max_tokens": 2}},
        {"custom_id": "refused", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": "2"}},
        {"custom_id": "elsewhere", "method": "POST", "url": "/v1/audio/speech", "body": {}},
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    assert main(["run-batch", "-i", str(source), "-o", str(target), "--kv-cache-memory", "16MiB",
                 "--max-model-len", "256"]) == 0
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["chat", "text", "refused", "elsewhere"]
    assert [line["response"]["body"]["object"] for line in lines[:2]] == ["chat.completion", "text_completion"]
    assert lines[2]["response"]["status_code"] == 400 and lines[2]["response"]["body"]["error"]["param"] == "max_tokens"
    assert lines[3]["response"] is None and lines[3]["error"]["code"] == "invalid_url"
    assert "run-batch: 4/4 lines, 2 failed" in capsys.readouterr().err


def test_run_batch_refuses_duplicate_custom_ids_before_loading(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    line = {"custom_id": "same", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    source.write_text(json.dumps(line) + "\n" + json.dumps(line) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert "custom_id 'same'" in capsys.readouterr().err
