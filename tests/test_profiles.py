import pytest

from specdec_cli.errors import ProfileError
from specdec_cli.profiles import DEFAULT_PROFILE, list_profiles, load_profile, scan_profiles
from tests.isolation import module_specdec_home, specdec_home  # noqa: F401  (autouse)

SHIPPED = {"demo", "demo-ngram", "qwen2.5-7b", "qwen2.5-7b-4bit", "qwen2.5-coder-7b", "llama-3.1-8b", "gemma-2-9b"}


def _user_profile(home, name, text):
    folder = home / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def test_the_shipped_profiles_parse():
    assert {profile.name for profile in list_profiles()} == SHIPPED


def test_the_default_is_the_offline_demo_pair():
    profile = load_profile(DEFAULT_PROFILE)
    assert (profile.target, profile.draft, profile.drafter) == ("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", "cascade")
    assert profile.k == "auto"
    assert profile.path.name == "demo.toml"


def test_the_ngram_profile_has_no_draft():
    profile = load_profile("demo-ngram")
    assert (profile.drafter, profile.draft, profile.draft_quantization) == ("ngram", None, None)


def test_the_4bit_profile_quantises_the_target_only():
    profile = load_profile("qwen2.5-7b-4bit")
    assert (profile.target_quantization, profile.draft_quantization) == ("4bit", "auto")  # a draft unnamed: auto


def test_a_user_profile_is_added(specdec_home):
    _user_profile(specdec_home, "mine", 'target = "org/big"\ndraft = "org/small"\nk = 6\ntemperature = 0.0\n')
    profile = load_profile("mine")
    assert (profile.target, profile.draft, profile.drafter, profile.k, profile.temperature) == ("org/big", "org/small", "model", 6, 0.0)
    assert "mine" in {profile.name for profile in list_profiles()}


def test_a_relative_model_path_is_the_profile_files_neighbour(specdec_home, tmp_path, monkeypatch, tiny_pair):
    """`target = "models/big"` named a path from wherever the command ran: the profile worked in one folder and said
    "no such file" in the next. It is the path beside the profile file where that exists; a hub id, a path from the
    current folder and demo: stay as written. The run loads the model from there, from another folder."""
    import shutil

    from typer.testing import CliRunner

    from specdec_cli.cli import app
    from tests.cli_result import assert_exited

    models = specdec_home / "profiles" / "models"
    shutil.copytree(tiny_pair.target, models / "big")
    shutil.copytree(tiny_pair.draft, models / "small")
    _user_profile(specdec_home, "mine", 'target = "models/big"\ndraft = "./models/small"\ntemperature = 0.0\n')
    profile = load_profile("mine")
    assert (profile.target, profile.draft) == (str((models / "big").resolve()), str((models / "small").resolve()))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "in.jsonl").write_text('{"prompt": "Hi"}\n')
    result = CliRunner().invoke(app, ["run", "in.jsonl", "-o", "out.jsonl", "--profile", "mine", "--dtype", "float32",
                                      "-n", "3", "-q"])
    assert_exited(result, 0)
    assert (tmp_path / "elsewhere" / "out.jsonl").is_file()
    _user_profile(specdec_home, "hub", 'target = "org/big"\ndraft = "small"\n')  # nothing of those names beside it
    assert (load_profile("hub").target, load_profile("hub").draft) == ("org/big", "small")


def test_a_user_profile_overrides_a_shipped_one(specdec_home):
    path = _user_profile(specdec_home, "demo", 'target = "demo:qwen2.5-coder-1.5b"\ndrafter = "ngram"\n')
    profile = load_profile("demo")
    assert (profile.drafter, profile.draft, profile.path) == ("ngram", None, path)
    assert [p.drafter for p in list_profiles() if p.name == "demo"] == ["ngram"]


def test_an_unknown_profile_lists_the_known_ones():
    with pytest.raises(ProfileError, match="unknown profile 'nope'") as raised:
        load_profile("nope")
    assert "demo, demo-ngram, gemma-2-9b" in raised.value.hint


def test_malformed_toml_names_the_file_and_line(specdec_home):
    path = _user_profile(specdec_home, "broken", 'target = "org/big"\ndraft = org/small\n')
    with pytest.raises(ProfileError) as raised:
        load_profile("broken")
    assert str(path) in raised.value.message
    assert "line 2" in raised.value.message


def test_a_profile_that_is_not_utf8_is_one_line_and_the_others_still_list(specdec_home):
    """A file saved in another encoding was a UnicodeDecodeError traceback in `profiles list` and with --profile."""
    path = specdec_home / "profiles" / "latin.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes('target = "org/big"\ndescription = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ProfileError) as raised:
        load_profile("latin")
    assert raised.value.one_line() == (f"profile file {path} is not UTF-8 text (a bad byte at offset 37) — save it as "
                                       "UTF-8, as TOML files must be, or remove it")
    profiles, problems = scan_profiles()
    assert "demo" in [profile.name for profile in profiles] and [p.message for p in problems] == [raised.value.message]


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('draft = "org/small"\n', "`target` (a model name) is required"),
        ('target = "org/big"\ntempreature = 0.1\n', "unknown key(s) tempreature (tempreature: did you mean temperature?); known:"),
        ('target = "org/big"\nflavour = 1\n', "unknown key(s) flavour; known:"),
        ('target = "org/big"\ndrafter = "model"\n', 'drafter "model" needs a `draft`'),
        ('target = "org/big"\ndrafter = "forest"\n', "`drafter` must be one of model, ngram, cascade, tree, not 'forest'"),
        ('target = "org/big"\ntarget_quantization = "3bit"\n', "`target_quantization` must be one of none, auto, int8, int4, q4, nf4, bnb8, 4bit, 8bit, not '3bit'"),
        ('target = "org/big"\nk = 99\n', '`k` must be "auto" or a whole number from 0 to 16, not 99'),
        ('target = "org/big"\ntop_p = 1.5\n', "`top_p` must be a number above 0 and at most 1, not 1.5"),
        ('target = "org/big"\ntemperature = "hot"\n', "`temperature` must be a finite number >= 0 (0 = greedy), not 'hot'"),
        # what `profiles show` used to accept and `run` rejected or misused later
        ('target = "org/big"\ndraft = 5\n', "`draft` must be a model name (a non-empty string), not 5"),
        ('target = "org/big"\ndtype = "float64"\n', "`dtype` must be one of auto, bfloat16, bf16, float16, fp16, half, float32, fp32, not 'float64'"),
        ('target = "org/big"\ndevice = "tpu"\n', "`device` must be auto, cpu, cuda, cuda:N or mps, not 'tpu'"),
        ('target = "org/big"\ndraft = "org/small"\ndraft_quantization = "int3"\n', "`draft_quantization` must be one of"),
        ('target = "org/big"\nsystem = 3\n', "`system` must be a string, not 3"),
        ('target = 7\n', "`target` must be a model name (a non-empty string), not 7"),
        ('target = ""\n', "`target` must be a model name (a non-empty string), not ''"),
        ('target = "org/big"\ntemperature = nan\n', "`temperature` must be a finite number >= 0 (0 = greedy), not nan"),
        ('target = "org/big"\ntemperature = inf\n', "`temperature` must be a finite number >= 0 (0 = greedy), not inf"),
        ('target = "org/big"\ntop_p = nan\n', "`top_p` must be a number above 0 and at most 1, not nan"),
        ('target = "org/big"\ntop_k = 2.5\n', "`top_k` must be a whole number >= 0 (0 = off), not 2.5"),
        ('target = "org/big"\nmax_new_tokens = true\n', "`max_new_tokens` must be a whole number >= 1, not True"),
        ('target = "org/big"\nmax_new_tokens = 0\n', "`max_new_tokens` must be a whole number >= 1, not 0"),
        ('target = "org/big"\nweights_gb = -1\n', "`weights_gb` must be a number above 0, not -1"),
        ('target = "org/big"\ndescription = ["a"]\n', "`description` must be a string, not ['a']"),
    ],
)
def test_invalid_profiles_say_what_is_wrong(specdec_home, text, complaint):
    path = _user_profile(specdec_home, "bad", text)
    with pytest.raises(ProfileError) as raised:
        load_profile("bad")
    assert raised.value.message.startswith(f"profile file {path}: ")
    assert complaint in raised.value.message
    assert raised.value.hint == "fix the file or remove it"


@pytest.mark.parametrize("quantization", ["none", "auto", "int8", "int4", "q4", "nf4", "bnb8", "4bit", "8bit"])
def test_every_quantisation_name_is_accepted(specdec_home, quantization):
    _user_profile(specdec_home, "q", f'target = "org/big"\ndraft = "org/small"\ntarget_quantization = "{quantization}"\n'
                                     f'draft_quantization = "{quantization}"\n')
    profile = load_profile("q")
    # "none" stays "none": float asked for, which a default (a 4-bit .gguf's q4, the draft's auto) does not replace
    assert (profile.target_quantization, profile.draft_quantization) == (quantization, quantization)


def test_good_values_at_the_edges_are_accepted(specdec_home):
    _user_profile(specdec_home, "edges", 'target = "org/big"\ndraft = "org/small"\nk = 0\ntemperature = 0\ntop_p = 1\n'
                                         'top_k = 0\nmax_new_tokens = 1\ndevice = "cuda:1"\ndtype = "bf16"\nsystem = ""\n')
    profile = load_profile("edges")
    assert (profile.k, profile.temperature, profile.top_p, profile.device, profile.dtype) == (0, 0, 1, "cuda:1", "bf16")


def test_one_broken_profile_leaves_the_others_listed(specdec_home):
    path = _user_profile(specdec_home, "broken", 'target = "org/big"\ndraft = 5\n')
    _user_profile(specdec_home, "fine", 'target = "org/big"\n')
    profiles, problems = scan_profiles()
    assert {profile.name for profile in profiles} == SHIPPED | {"fine"}
    assert [problem.message for problem in problems] == [
        f"profile file {path}: `draft` must be a model name (a non-empty string), not 5"]
    assert {profile.name for profile in list_profiles()} == SHIPPED | {"fine"}


@pytest.mark.real
@pytest.mark.parametrize("name", ["demo", "demo-ngram"])
def test_the_demo_hints_are_what_the_estimate_computes_from_the_gguf_configs(name):
    """`profiles list` shows the hint until the pair is converted, the estimate after: they must agree."""
    import torch
    from transformers import AutoConfig

    from specdec_cli.errors import MissingExtraError
    from specdec_cli.models.loading import demo
    from specdec_cli.models.loading.preflight import estimate_weight_bytes

    profile = load_profile(name)
    total = 0
    for spec, quantization in ((profile.target, profile.target_quantization), (profile.draft, profile.draft_quantization)):
        if spec is None:
            continue
        try:
            path = demo.ensure_joined(demo.demo_model(spec), progress=False)
        except MissingExtraError:
            pytest.skip("the demo pair is not installed")
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        total += estimate_weight_bytes(config, torch.bfloat16, quantization)
    assert round(total / 1e9, 1) == profile.weights_gb
