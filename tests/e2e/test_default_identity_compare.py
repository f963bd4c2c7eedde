"""The shipped default is lossless in `compare` as in `chat` and `run` (test_default_identity.py, whose module
docstring says what is compared): `compare` on the demo profile finds its default token for token the target alone on
every prompt, and says so (n/n) in its table."""

import json
import re

import pytest

from tests.e2e.test_default_identity import QUESTIONS, greedy
from tests.models.test_demo_real import requires_demo

pytestmark = [pytest.mark.real, requires_demo, pytest.mark.timeout(2400)]


def test_compare_finds_the_default_identical_to_the_target_alone_on_every_prompt(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    process = greedy("compare", "--prompts", str(prompts), "--n-prompts", str(len(QUESTIONS)), "--json", "out.json",
                     cwd=tmp_path)
    report = json.loads((tmp_path / "out.json").read_text())
    runs = {(run["prompt_index"], run["configuration"]): run for run in report["runs"]}
    assert sorted({configuration for _, configuration in runs}) == ["cascade k=auto", "target alone"]
    identical = [runs[i, "cascade k=auto"]["tokens"] == runs[i, "target alone"]["tokens"] for i in range(len(QUESTIONS))]
    assert sum(identical) == len(QUESTIONS)
    assert all(len(runs[i, "target alone"]["tokens"]) >= 8 for i in range(len(QUESTIONS)))
    assert sum(runs[i, "cascade k=auto"]["accepted"] for i in range(len(QUESTIONS))) > 0
    assert sum(runs[i, "target alone"]["drafted"] for i in range(len(QUESTIONS))) == 0
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in process.stdout.splitlines() if line.startswith("│")]
    shown = {row[0]: row[-1] for row in rows if len(row) > 8}
    assert shown == {"target alone": f"{len(QUESTIONS)}/{len(QUESTIONS)}", "cascade k=auto": f"{len(QUESTIONS)}/{len(QUESTIONS)}"}
    assert re.fullmatch(r"\d+/\d+", shown["cascade k=auto"])
