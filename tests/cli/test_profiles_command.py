import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app

from tests.cli_result import assert_exited

WIDE = {"COLUMNS": "250"}


def run(*args):
    return CliRunner().invoke(app, list(args), env=WIDE)


def test_profiles_list_shows_every_profile_with_its_pair_and_estimate():
    result = run("profiles", "list")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:6]] for line in result.stdout.splitlines() if line.startswith("│")}
    assert rows["demo (default)"][:2] == ["demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b (+ n-gram)"]
    assert rows["demo-ngram"][1] == "(n-gram)"
    assert rows["qwen2.5-7b-4bit"] == ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "target 4bit, draft auto", "~6.6 GB"]
    assert rows["llama-3.1-8b"][0] == "meta-llama/Llama-3.1-8B-Instruct"


def test_profiles_list_estimates_from_a_local_config(specdec_home, tmp_path):
    from tests.tiny import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    (specdec_home / "profiles").mkdir(parents=True)
    (specdec_home / "profiles" / "tiny.toml").write_text(f'target = "{tmp_path / "tiny"}"\ndtype = "float32"\n')
    result = run("profiles", "list")
    tiny_row = next(line for line in result.stdout.splitlines() if line.startswith("│ tiny "))
    assert "0.0 GB" in tiny_row  # computed from config.json (0.2 MB), not a hint


def test_profiles_show_prints_every_setting():
    result = run("profiles", "show", "demo-ngram")
    assert result.exit_code == 0, result.output
    settings = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    assert settings["target"].strip() == "demo:qwen2.5-coder-1.5b"
    assert settings["drafter"].strip() == "ngram"
    assert settings["draft"].strip() == "-"
    assert settings["max_new_tokens"].strip() == "512"


def test_an_unknown_profile_is_one_error_line_and_exit_2():
    result = run("profiles", "show", "nope")
    assert_exited(result, 2)
    assert result.stdout == ""
    assert result.stderr.startswith("error: unknown profile 'nope' — known profiles: demo, demo-ngram")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_malformed_user_profile_is_one_error_line(specdec_home):
    (specdec_home / "profiles").mkdir(parents=True)
    (specdec_home / "profiles" / "broken.toml").write_text("target = \n")
    result = run("profiles", "list")
    assert result.exit_code == 2
    assert "broken.toml is not valid TOML" in result.stderr
    assert "line 1" in result.stderr


def test_profiles_list_lists_the_good_ones_and_names_the_broken_ones(specdec_home):
    folder = specdec_home / "profiles"
    folder.mkdir(parents=True)
    (folder / "typo.toml").write_text('target = "org/big"\ndraft = 5\n')
    (folder / "hot.toml").write_text('target = "org/big"\ntemperature = nan\n')
    (folder / "fine.toml").write_text('target = "org/big"\n')
    result = run("profiles", "list")
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    names = [line.split("│")[1].strip() for line in result.stdout.splitlines() if line.startswith("│")]
    assert "fine" in names and "demo (default)" in names and "typo" not in names and "hot" not in names
    assert result.stderr.splitlines() == [
        f"error: profile file {folder / 'hot.toml'}: `temperature` must be a finite number >= 0 (0 = greedy), not nan — fix the file or remove it",
        f"error: profile file {folder / 'typo.toml'}: `draft` must be a model name (a non-empty string), not 5 — fix the file or remove it",
    ]


@pytest.mark.parametrize(("text", "complaint"), [
    ('target = "org/big"\ndraft = 5\n', "`draft` must be a model name (a non-empty string), not 5"),
    ('target = "org/big"\ndtype = "float64"\n', "`dtype` must be one of auto, bfloat16, bf16, float16, fp16, half, float32, fp32, not 'float64'"),
    ('target = "org/big"\nk = 99\n', '`k` must be "auto" or a whole number from 0 to 16, not 99'),
])
def test_profiles_show_refuses_a_broken_profile_in_one_line(specdec_home, text, complaint):
    (specdec_home / "profiles").mkdir(parents=True)
    (specdec_home / "profiles" / "bad.toml").write_text(text)
    result = run("profiles", "show", "bad")
    assert result.exit_code == 2
    assert (result.stdout, result.stderr) == (
        "", f"error: profile file {specdec_home / 'profiles' / 'bad.toml'}: {complaint} — fix the file or remove it\n")


def _show_estimate(name: str) -> str:
    result = run("profiles", "show", name)
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert not any(line.startswith("weights_gb") for line in lines)  # one figure, not a hint beside an estimate
    return next(line.removeprefix("weights (est.)").strip() for line in lines if line.startswith("weights (est.)"))


def _list_estimate(name: str) -> str:
    result = run("profiles", "list")
    row = next(line for line in result.stdout.splitlines() if line.startswith(f"│ {name} "))
    return row.split("│")[5].strip()


def test_list_and_show_give_one_memory_figure_from_a_local_config(specdec_home, tmp_path):
    from tests.tiny import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    (specdec_home / "profiles").mkdir(parents=True)
    (specdec_home / "profiles" / "tiny.toml").write_text(
        f'target = "{tmp_path / "tiny"}"\ndtype = "float32"\nweights_gb = 9.9\n')  # a stale hint
    assert _show_estimate("tiny") == _list_estimate("tiny") == "0.0 GB"


def test_list_and_show_give_one_memory_figure_from_a_hint():
    assert _show_estimate("demo") == _list_estimate("demo (default)") == "~3.5 GB"


@pytest.mark.parametrize("config", ['{"model_type": "qwen2", "num_attention_heads": 0}', '{"model_type": "qwen2",'])
def test_a_profile_whose_local_config_is_broken_still_lists(specdec_home, tmp_path, config):
    """The estimate builds the model from a local config: a broken one (heads of 0, JSON cut short) was a traceback
    in `profiles list` and `show`, hiding every other profile. Its estimate is "?" now; loading it says what is wrong."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(config)
    (specdec_home / "profiles").mkdir(parents=True)
    (specdec_home / "profiles" / "broken.toml").write_text(f'target = "{tmp_path / "model"}"\ndrafter = "ngram"\n')
    result = run("profiles", "list")
    assert_exited(result, 0)
    assert _list_estimate("broken") == "?" and "demo (default)" in result.stdout
    assert _show_estimate("broken") == "?"


def test_profiles_list_says_which_profiles_fit_this_machines_free_memory(specdec_home, monkeypatch):
    """With 10 GiB free: the nf4 7B pair (~6.6 GB) fits, the bf16 one (~16.2 GB) does not, and a profile whose
    weights cannot be estimated here (no config on this machine, no hint) is unknown."""
    from specdec_cli.models import device

    monkeypatch.setattr(device, "available_memory_bytes", lambda where: 10 * 1024**3)
    (specdec_home / "profiles").mkdir(parents=True)
    (specdec_home / "profiles" / "unsized.toml").write_text('target = "org/not-here"\n')
    result = run("profiles", "list")
    assert_exited(result, 0)
    fits = {line.split("│")[1].strip(): line.split("│")[6].strip() for line in result.stdout.splitlines()
            if line.startswith("│")}
    assert fits["qwen2.5-7b-4bit"] == "yes (~6.1 GiB of 10.0 GiB free)"
    assert fits["qwen2.5-7b"] == "no (needs ~15.1 GiB, 10.0 GiB free)"
    assert fits["unsized"] == "unknown"
    shown = run("profiles", "show", "qwen2.5-7b")
    assert [line.split(None, 2)[2].strip() for line in shown.stdout.splitlines() if line.strip().startswith("fits here")] \
        == ["no (needs ~15.1 GiB, 10.0 GiB free)"]
