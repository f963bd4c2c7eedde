"""The measurement loop on tiny saved models (fp32): order, lossless counts, HF peers, token counting."""

import json

import pytest

from specdec_cli import bench
from specdec_cli.engine import SamplingParams
from specdec_cli.models import load_pair
from specdec_cli.prompts import Prompt

PROMPTS = [
    Prompt("p1", "code", text="def add(a, b):", as_user_turn=True),
    Prompt("p2", "chat", text="Hello, how are you today?", as_user_turn=True),
]
GREEDY = bench.BenchSettings(SamplingParams(), max_new_tokens=10)


@pytest.fixture(scope="module")
def low_acceptance_pair(tiny_pair):
    return load_pair(tiny_pair.target, tiny_pair.draft, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def identical_pair(tiny_pair):
    return load_pair(tiny_pair.target, tiny_pair.same, device="cpu", dtype="float32", progress=False)


def measured(pair, drafters, ks, with_hf, settings=GREEDY, prompts=PROMPTS):
    target, draft = pair
    configs = bench.configurations(drafters, ks, with_hf, draft is not None)
    benchmark = bench.Benchmark(target, draft, configs, prompts, settings)
    benchmark.measure()
    return benchmark


@pytest.fixture(scope="module")
def low_acceptance(low_acceptance_pair):
    return measured(low_acceptance_pair, ["model", "ngram"], [2], with_hf=True)


def tokens_of(benchmark, configuration):
    return {run.prompt_index: run.tokens for run in benchmark.runs if run.configuration == configuration}


def test_runs_are_prompt_major_and_every_configuration_runs_on_every_prompt(low_acceptance):
    names = [config.name for config in low_acceptance.configs]
    executed = [(run.prompt_index, run.repeat, run.configuration) for run in low_acceptance.runs]
    assert executed == [(p, r, names[i]) for p, r, i in low_acceptance.order]
    assert [prompt for prompt, _, _ in executed] == [0] * len(names) + [1] * len(names)
    assert sorted(executed[: len(names)], key=lambda e: names.index(e[2])) == [(0, 0, name) for name in names]


def test_greedy_speculation_and_hf_give_the_baselines_tokens(low_acceptance):
    baseline = tokens_of(low_acceptance, "target alone")
    assert all(len(tokens) == 10 for tokens in baseline.values())
    for config in low_acceptance.configs:
        assert tokens_of(low_acceptance, config.name) == baseline, config.name
    rows = {row["configuration"]: row for row in low_acceptance.summary()}
    assert {name: (row["identical"], row["compared"]) for name, row in rows.items()} == {name: (2, 2) for name in rows}


def test_a_different_draft_is_mostly_rejected_yet_drafts(low_acceptance):
    row = {row["configuration"]: row for row in low_acceptance.summary()}["model k=2"]
    assert row["acceptance_rate"] < 0.5
    assert row["acceptance_at"][0] is not None and row["acceptance_at"][2] is None  # k=2 never drafts position 3
    assert row["theory"]["gamma"] == pytest.approx(sum(r.drafted for r in low_acceptance.runs if r.configuration == "model k=2") /
                                                  sum(r.steps for r in low_acceptance.runs if r.configuration == "model k=2"))


def test_each_configuration_counts_the_models_it_runs(low_acceptance):
    assert low_acceptance.models_used == {
        "target alone": ["target"], "model k=2": ["target", "draft"], "ngram k=2": ["target"],
        "HF assisted": ["target", "draft"], "HF prompt lookup (10)": ["target"],
    }
    weights = low_acceptance.weight_bytes
    rows = {row["configuration"]: row for row in low_acceptance.summary()}
    assert rows["ngram k=2"]["memory_bytes"] >= weights["target"]
    assert rows["model k=2"]["memory_bytes"] >= weights["target"] + weights["draft"]


def test_hf_steps_are_its_target_forwards(low_acceptance):
    lookup = [run for run in low_acceptance.runs if run.configuration.startswith("HF prompt lookup")]
    assert all(1 <= run.steps <= len(run.tokens) for run in lookup)
    assert all(run.drafted is None for run in lookup)


def test_by_category_rows_cover_only_that_categorys_prompt(low_acceptance):
    assert low_acceptance.categories() == ["code", "chat"]
    chat = {row["configuration"]: row for row in low_acceptance.summary("chat")}
    assert chat["target alone"]["new_tokens"] == 10 and chat["target alone"]["prompts"] == 1


def test_the_report_holds_every_raw_run_and_the_environment(low_acceptance):
    report = json.loads(json.dumps(low_acceptance.report(by_category=True)))
    assert report["schema"] == "specdec.compare/1"
    assert {"device", "dtype", "torch", "transformers", "cpu_count", "torch_threads", "target", "draft", "cpu",
            "cpu_flags"} <= set(report["environment"])
    assert report["environment"]["dtype"] == "float32"
    assert report["environment"]["target_prompt_read"] == "target"  # no bfloat16 copy (--prefill) for a float target
    assert len(report["runs"]) == 2 * len(low_acceptance.configs)
    assert {"tokens", "seconds", "steps", "drafted", "accepted", "drafted_at", "accepted_at", "draft_seconds",
            "verify_seconds", "working_bytes", "finish_reason"} <= set(report["runs"][0])
    assert [p["id"] for p in report["prompts"]] == ["p1", "p2"]
    assert set(report["summary_by_category"]) == {"code", "chat"}
    assert report["settings"]["max_new_tokens"] == 10 and report["settings"]["hf_prompt_lookup_num_tokens"] == 10
    assert report["order"][0] == [0, 0, "target alone"]


def test_an_identical_draft_is_always_accepted(identical_pair):
    # A fixed k: on tiny models a draft costs as much as the target, so k=auto may rightly not draft.
    benchmark = measured(identical_pair, ["model"], ["4"], with_hf=False)
    row = {row["configuration"]: row for row in benchmark.summary()}["model k=4"]
    assert row["acceptance_rate"] == 1.0 and row["acceptance_at"][:3] == [1.0, 1.0, 1.0]
    assert (row["identical"], row["compared"]) == (2, 2)
    assert row["theory"]["alpha"] == 1.0


def test_hf_counts_new_tokens_like_the_engine_up_to_and_including_eos(low_acceptance_pair, monkeypatch):
    """Make a token the target emits mid-output an EOS id: every configuration must stop right after it."""
    plain = measured(low_acceptance_pair, ["ngram"], [2], with_hf=False, prompts=PROMPTS[:1])
    emitted = tokens_of(plain, "target alone")[0]
    eos = emitted[4]
    monkeypatch.setattr("specdec_cli.session.eos_token_ids", lambda model: (eos,))
    monkeypatch.setattr("specdec_cli.bench.measure.eos_token_ids", lambda model: (eos,))
    stopped = measured(low_acceptance_pair, ["model"], [2], with_hf=True, prompts=PROMPTS[:1])
    expected = emitted[: emitted.index(eos) + 1]
    for config in stopped.configs:
        assert tokens_of(stopped, config.name)[0] == expected, config.name
    assert {run.finish_reason for run in stopped.runs} == {"stop"}


def test_sampled_runs_have_no_identical_column(low_acceptance_pair):
    settings = bench.BenchSettings(SamplingParams(temperature=0.8, seed=0), max_new_tokens=8)
    benchmark = measured(low_acceptance_pair, ["ngram"], [2], with_hf=True, settings=settings, prompts=PROMPTS[:1])
    assert all(row["identical"] is None for row in benchmark.summary())
    assert all(len(run.tokens) >= 1 for run in benchmark.runs)


def test_with_an_int8_draft_hf_assisted_runs_with_the_plain_draft_and_with_ours(low_acceptance_pair):
    import copy
    import dataclasses

    from specdec_cli.models.runtime.quantize import quantize_int8_dynamic

    target, plain = low_acceptance_pair
    int8 = dataclasses.replace(plain, model=quantize_int8_dynamic(copy.deepcopy(plain.model)), quantization="int8")
    configs = bench.configurations(["model"], [2], True, True, plain_draft="int8")
    benchmark = bench.Benchmark(target, int8, configs, PROMPTS[:1], GREEDY, plain_draft=plain)
    benchmark.measure()
    assert benchmark.models_used["HF assisted"] == ["target", "plain draft"]
    assert benchmark.models_used["HF assisted (int8 draft)"] == ["target", "draft"]
    assert benchmark.models_used["model k=2"] == ["target", "draft"]
    baseline = tokens_of(benchmark, "target alone")
    assert all(tokens_of(benchmark, config.name) == baseline for config in configs)
    rows = {row["configuration"]: row for row in benchmark.summary()}
    assert rows["HF assisted"]["memory_bytes"] >= benchmark.weight_bytes["target"] + benchmark.weight_bytes["plain draft"]


def test_a_draft_run_through_a_subset_head_counts_as_the_draft(low_acceptance_pair):
    """The demo's drafters score a subset of the draft's vocabulary (drafters/subset_head.py): their forwards never call
    the draft's top-level module, and must still count as the draft's, or `compare` leaves its weights out."""
    import torch

    from specdec_cli.bench.probes import ForwardCounter
    from specdec_cli.drafters.subset_head import SubsetHeadLM

    target, draft = low_acceptance_pair
    counter = ForwardCounter({"target": target.model, "draft": draft.model})
    try:
        with torch.no_grad():
            SubsetHeadLM(draft.model, torch.arange(50))(torch.tensor([[1, 2, 3]]), use_cache=False)
            target.model(torch.tensor([[1, 2, 3]]), use_cache=False)
    finally:
        counter.close()
    assert counter.counts == {"target": 1, "draft": 1}


def test_a_benchmarks_background_load_counts_a_process_spinning_while_it_measures():
    import subprocess
    import sys
    import time

    from specdec_cli.bench.probes import BackgroundLoad

    background = BackgroundLoad()
    assert background.cores() is None  # not begun
    background.begin()
    if background.start is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(1.0)
        assert background.cores() >= 0.5
    finally:
        spinner.kill()
        spinner.wait(timeout=30)


def test_a_prompts_system_prompt_opens_the_user_turn_where_the_template_has_no_system_role():
    """compare with a profile's system prompt on a model whose template raises on a system role (Gemma's) stopped
    in one line; the system prompt now opens the user turn, as chat and run do with it."""
    from specdec_cli.bench.measure import encode_prompt
    from specdec_cli.errors import ChatTemplateError
    from specdec_cli.session import encode_chat

    from tests.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    guard = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    tokenizer.chat_template = guard + tokenizer.chat_template
    prompt = Prompt(id="1", category="qa", text="Who are you?", as_user_turn=True)
    with pytest.raises(ChatTemplateError):
        encode_chat(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}])
    assert encode_prompt(prompt, tokenizer, system="Be brief.") == encode_chat(
        tokenizer, [{"role": "user", "content": "Be brief.\n\nWho are you?"}])
    assert encode_prompt(prompt, tokenizer) == encode_chat(tokenizer, [{"role": "user", "content": "Who are you?"}])
