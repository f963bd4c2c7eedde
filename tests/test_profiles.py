import pytest

from specdec_cli.errors import ProfileError
from specdec_cli.profiles import DEFAULT_PROFILE, list_profiles, load_profile
from tests.isolation import specdec_home  # noqa: F401  (autouse)

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
    assert (profile.target_quantization, profile.draft_quantization) == ("4bit", None)


def test_a_user_profile_is_added(specdec_home):
    _user_profile(specdec_home, "mine", 'target = "org/big"\ndraft = "org/small"\nk = 6\ntemperature = 0.0\n')
    profile = load_profile("mine")
    assert (profile.target, profile.draft, profile.drafter, profile.k, profile.temperature) == ("org/big", "org/small", "model", 6, 0.0)
    assert "mine" in {profile.name for profile in list_profiles()}


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


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('draft = "org/small"\n', "`target` (a model name) is required"),
        ('target = "org/big"\ntempreature = 0.1\n', "unknown key(s) tempreature"),
        ('target = "org/big"\ndrafter = "model"\n', 'drafter "model" needs a `draft`'),
        ('target = "org/big"\ndrafter = "forest"\n', "drafter must be one of model, ngram"),
        ('target = "org/big"\ntarget_quantization = "3bit"\n', "quantization must be"),
        ('target = "org/big"\nk = 0\n', "k must be"),
        ('target = "org/big"\ntop_p = 1.5\n', "top_p"),
        ('target = "org/big"\ntemperature = "hot"\n', "a number field holds text"),
    ],
)
def test_invalid_profiles_say_what_is_wrong(specdec_home, text, complaint):
    _user_profile(specdec_home, "bad", text)
    with pytest.raises(ProfileError) as raised:
        load_profile("bad")
    assert complaint in raised.value.message
