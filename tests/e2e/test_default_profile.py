"""What a user runs first: the installed `specdec` console script on its default profile (the offline demo
pair: cascade drafting, target and draft in the formats `auto` picks on this machine (int8 on a CPU until
`specdec calibrate` measured it; q4 for both on this project's AVX512 machine after it), k = auto with the odds cut, sampled at the profile's
temperature / top-p / top-k). No model option is given; only the token budget (and a seed) are set, to keep
each test to a minute or two.

Loads the real pair (needs `pip install 'specdec[demo]'`; converted once per machine into the user's cache).
In CI a skip here is a failure (tests/conftest.py)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_cli.models.formats.quant import precision
from tests.models.test_demo_real import requires_demo
from tests.run.test_run_command import without_timings

pytestmark = [pytest.mark.real, requires_demo, pytest.mark.timeout(1800)]  # up to two `specdec` calls of 900 s each

ROOT = Path(__file__).resolve().parents[2]
SPECDEC = Path(sys.executable).with_name("specdec")  # the console script installed beside this Python
STATS_LINE = re.compile(
    r"(?P<new>\d+) tokens? · [\d.]+ tok/s · (?:\d+% accepted \((?P<accepted>\d+)/(?P<drafted>\d+) drafted\)|nothing drafted)"
    r"(?: · no drafting on \d+/\d+ steps \([^)]*\))?"  # where the policy stopped drafting: on how many steps, and why
    r" · (?P<per_step>[\d.]+) tokens/step · draft [\d.]+s, verify [\d.]+s(?P<cut> · cut at \d+ tokens \(--max-new-tokens\))?"
)


def specdec(*args: str, stdin: str | None = None, cwd: Path) -> subprocess.CompletedProcess:
    """`specdec ARGS` as a user runs it: the console script, this tree first on the path, no colour."""
    assert SPECDEC.is_file(), f"no console script at {SPECDEC}: install the project (pip install -e '.[test,demo]')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("SPECDEC_DEBUG", None)
    return subprocess.run([str(SPECDEC), *args], input=stdin, capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=900)


def check_models_line(stderr: str) -> None:
    target_line = re.search(r"^target: demo:qwen2\.5-coder-1\.5b · .*$", stderr, re.M)
    draft_line = re.search(r"^draft: demo:qwen2\.5-coder-0\.5b · .*$", stderr, re.M)
    assert target_line and draft_line, stderr[-2000:]
    if not torch.cuda.is_available():  # the profile's auto formats, as this machine resolves them
        from specdec_cli.models.loading import prefill

        specs = {"target": "demo:qwen2.5-coder-1.5b", "draft": "demo:qwen2.5-coder-0.5b"}
        formats = {role: auto_format(role, spec) for role, spec in specs.items()}
        # --prefill auto: the target's prompts are read in bfloat16 where this machine takes it (AMX, calibration)
        read = prefill.resolve("auto", torch.device("cpu"), specs["target"], formats["target"], specs["draft"],
                               formats["draft"])
        for line, role in ((target_line, "target"), (draft_line, "draft")):
            expected = formats[role]
            assert expected in ("int8", "int4", "q4"), expected
            # q4 keeps every layer of the demo files as the file has it (Q4_K in q4, gguf_q4.py; Q5_0, Q6_K and Q8_0
            # as levels layers, gguf_levels.py), says how many, and names no requantised type
            kept = {"target": " · 197 of 197", "draft": " · 169 of 169"}[role] if expected == "q4" else ""
            types = {"target": "168 Q4_K, 29 Q6_K", "draft": "132 Q5_0, 13 Q8_0, 12 Q4_K, 12 Q6_K"}[role]
            ending = f" · {precision(expected, '')}" + (
                f"{kept} layers kept as the .gguf's own blocks ({types})" if kept else "")
            # the draft too where the target does and it reads on AMX with its own q4 weights
            reads = read == "bf16" and (role == "target" or prefill.reads_on_amx(expected))
            ending += " · prompts read in bfloat16 (--prefill)" if reads else ""
            assert line.group(0).endswith(ending), (expected, read, line.group(0))


def auto_format(role: str, spec: str) -> str | None:
    from specdec_cli.models.device import resolve_dtype
    from specdec_cli.models.formats.quant import resolve_auto
    from specdec_cli.profiles import load_profile

    cpu = torch.device("cpu")
    allowed = load_profile("demo").target_auto_formats if role == "target" else None
    return resolve_auto(role, cpu, spec, resolve_dtype("auto", cpu), allowed)


def test_a_piped_chat_prints_the_reply_and_its_stats_and_saves_the_same(tmp_path):
    question = "Write a Python function that returns the square of a number."
    process = specdec("chat", "--max-new-tokens", "16", "--seed", "7", cwd=tmp_path,
                      stdin=f"{question}\n/save {tmp_path / 'chat.jsonl'}\n")
    assert process.returncode == 0, process.stderr[-3000:]
    check_models_line(process.stderr)
    assert "Traceback" not in process.stderr
    lines = process.stdout.splitlines()
    assert lines[-1] == f"saved 3 messages to {tmp_path / 'chat.jsonl'}"
    stats_at = next(i for i, line in enumerate(lines) if STATS_LINE.fullmatch(line))
    assert stats_at == len(lines) - 2  # the reply, its stats line, the /save answer
    printed_reply = "\n".join(lines[:stats_at])
    assert printed_reply.strip() and all(char.isprintable() or char in "\n\t" for char in printed_reply)

    system, user, assistant = (json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines())
    assert system == {"role": "system", "content": "You are a helpful coding assistant."}  # the profile's
    assert user == {"role": "user", "content": question}
    assert assistant["content"].rstrip("\n") == printed_reply.rstrip("\n")  # what was shown is what was kept
    stats, shown = assistant["stats"], STATS_LINE.fullmatch(lines[stats_at])
    assert 1 <= stats["new_tokens"] <= 16 and int(shown["new"]) == stats["new_tokens"]
    assert stats["drafted"] > 0 and (int(shown["accepted"]), int(shown["drafted"])) == (stats["accepted"], stats["drafted"])
    assert float(shown["per_step"]) == pytest.approx(stats["new_tokens"] / stats["steps"], abs=0.01)
    assert (assistant["finish_reason"] == "length") == bool(shown["cut"])
    assert {"length": stats["new_tokens"] == 16, "stop": stats["new_tokens"] <= 16}[assistant["finish_reason"]]


RECORDS = [
    {"id": "raw", "prompt": "def fibonacci(n):"},
    {"id": "chat", "messages": [{"role": "user", "content": "What is a Python list? One sentence."}]},
    {"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "anything", "messages": [{"role": "user", "content": "Name one sorting algorithm."}], "max_tokens": 8}},
]


def test_run_answers_every_line_and_the_same_seed_gives_the_same_file(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    outputs = []
    for name in ("one.jsonl", "two.jsonl"):
        process = specdec("run", "in.jsonl", "-o", name, "--max-new-tokens", "12", "--seed", "3", cwd=tmp_path)
        assert process.returncode == 0, process.stderr[-3000:]
        assert process.stdout == ""
        check_models_line(process.stderr)
        assert re.search(r"records\s+│ 3 of 3\b", process.stderr) and re.search(r"failed\s+│ 0\b", process.stderr)
        outputs.append([json.loads(line) for line in (tmp_path / name).read_text().splitlines()])
    raw, chat, openai = outputs[0]
    for record in (raw, chat):
        assert record["error"] is None and record["text"].strip()
        assert record["finish_reason"] in ("stop", "length") and 1 <= record["completion_tokens"] <= 12
        assert record["finish_reason"] == "stop" or record["completion_tokens"] == 12
    assert (raw["id"], chat["id"], openai["custom_id"]) == ("raw", "chat", "openai")
    body = openai["response"]["body"]
    assert openai["error"] is None and openai["response"]["status_code"] == 200
    assert body["choices"][0]["message"]["content"].strip() and 1 <= body["usage"]["completion_tokens"] <= 8
    assert sum(record["stats"]["drafted"] for record in (raw, chat)) + openai["specdec"]["drafted"] > 0
    assert without_timings(outputs[0]) == without_timings(outputs[1])  # sampled, and the same again


def test_compare_measures_the_default_against_the_target_alone(tmp_path):
    process = specdec("compare", "--category", "code", "--n-prompts", "2", "--max-new-tokens", "16",
                      "--json", "out.json", cwd=tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    check_models_line(process.stderr)
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in process.stdout.splitlines() if line.startswith("│")]
    measured = {row[0]: row for row in rows if len(row) > 8}
    assert set(measured) == {"target alone", "cascade k=auto"}
    assert measured["target alone"][3] == "×1.00"
    assert re.fullmatch(r"×\d+\.\d\d", measured["cascade k=auto"][3])
    assert [row[-1] for row in measured.values()] == ["2/2", "2/2"]  # the identical column: greedy is lossless

    report = json.loads((tmp_path / "out.json").read_text())
    assert [prompt["category"] for prompt in report["prompts"]] == ["code", "code"]
    assert sorted((run["prompt_index"], run["configuration"]) for run in report["runs"]) == [
        (0, "cascade k=auto"), (0, "target alone"), (1, "cascade k=auto"), (1, "target alone")]
    assert all(1 <= len(run["tokens"]) <= 16 for run in report["runs"])
    assert sum(run["drafted"] for run in report["runs"] if run["configuration"] == "cascade k=auto") > 0
    assert report["environment"]["target"] == "demo:qwen2.5-coder-1.5b"


def test_a_chat_ends_cleanly_while_its_prompt_copy_is_still_loading(tmp_path):
    """chat loads --prefill's bfloat16 copy in a thread (models/prefill.py; bf16 asks for it on any CPU without
    AMX-BF16: with it, a q4 target reads in bfloat16 with its own weights and there is nothing to load). A chat that
    ends while the load is under way waits for it: a process that ended with the thread inside torch was aborted
    ("terminate called without an active exception", exit -6). A long message waits for the copy, a short one not."""
    short = specdec("chat", "--prefill", "bf16", "--max-new-tokens", "4", cwd=tmp_path, stdin="Hi\n")
    assert short.returncode == 0, short.stderr[-3000:]
    assert "terminate called" not in short.stderr and "Traceback" not in short.stderr
    assert "prompts read in bfloat16 (--prefill)" in short.stderr
    long_message = " ".join(["Summarise this sentence about reading prompts in bfloat16 on a CPU."] * 16)
    both = specdec("chat", "--prefill", "bf16", "--max-new-tokens", "4", cwd=tmp_path,
                   stdin=f"{long_message}\nThanks\n")
    assert both.returncode == 0, both.stderr[-3000:]
    assert "Traceback" not in both.stderr and "did not load" not in both.stderr
    assert sum(bool(STATS_LINE.fullmatch(line)) for line in both.stdout.splitlines()) == 2
