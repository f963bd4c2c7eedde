import pytest
import torch

from specdec_cli.errors import InputError, ProfileError
from specdec_cli.settings import ModelOverrides, choose_models, load_choice


def choose(**flags):
    arguments = dict(profile=None, target=None, draft=None, drafter=None, device=None, dtype=None)
    return choose_models(ModelOverrides(**{**arguments, **flags}))


def test_no_model_options_means_the_demo_profile():
    choice = choose()
    assert choice.profile.name == "demo"
    assert (choice.target, choice.draft, choice.drafter) == ("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", "cascade")
    assert (choice.device, choice.dtype, choice.target_quantization, choice.draft_quantization) == ("auto", "auto", "auto", "auto")
    assert choice.profile.target_auto_formats == ("none", "int8", "q4")
    assert (choice.trust_remote_code, choice.allow_pickle) == (False, False)


def test_a_target_alone_uses_the_ngram_drafter():
    choice = choose(target="org/big")
    assert (choice.target, choice.draft, choice.drafter) == ("org/big", None, "ngram")


def test_a_target_and_a_draft_make_a_pair():
    choice = choose(target="org/big", draft="org/small")
    assert (choice.target, choice.draft, choice.drafter) == ("org/big", "org/small", "model")


def test_flags_override_the_profile():
    choice = choose(profile="qwen2.5-7b", draft="org/other-small", device="cpu", dtype="float32", draft_4bit=True)
    assert (choice.target, choice.draft) == ("Qwen/Qwen2.5-7B-Instruct", "org/other-small")
    assert (choice.device, choice.dtype) == ("cpu", "float32")
    assert (choice.target_quantization, choice.draft_quantization) == (None, "4bit")


def test_drafter_ngram_drops_the_profiles_draft():
    choice = choose(profile="qwen2.5-7b-4bit", drafter="ngram")
    assert (choice.draft, choice.drafter, choice.target_quantization, choice.draft_quantization) == (None, "ngram", "4bit", None)


def test_load_in_4bit_and_8bit_set_both_models():
    assert (choose(load_in_4bit=True).target_quantization, choose(load_in_4bit=True).draft_quantization) == ("4bit", "4bit")
    assert (choose(load_in_8bit=True).target_quantization, choose(load_in_8bit=True).draft_quantization) == ("8bit", "8bit")
    assert (choose(load_in_8bit=True, target_4bit=True).target_quantization) == "4bit"


def test_the_profiles_quantisation_is_kept_without_flags():
    assert choose(profile="qwen2.5-7b-4bit").target_quantization == "4bit"


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        ({"draft": "org/small", "drafter": "ngram"}, "contradict"),
        ({"target": "org/big", "drafter": "model"}, "--drafter model needs a draft model"),
        ({"drafter": "forest"}, "unknown drafter 'forest'"),
        ({"prefill": "fp8"}, "unknown --prefill 'fp8'"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "contradict"),
    ],
)
def test_contradictory_flags_are_input_errors(flags, complaint):
    with pytest.raises(InputError, match=complaint):
        choose(**flags)


def test_an_unknown_profile_is_a_profile_error():
    with pytest.raises(ProfileError):
        choose(profile="nope")


def test_load_choice_says_once_what_was_chosen(tmp_path):
    from rich.console import Console

    from tests.tiny import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    console = Console(record=True, width=200)
    target, draft = load_choice(choose(target=str(tmp_path / "tiny"), device="cpu", dtype="float32", target_quant="none"),
                                console)
    assert draft is None and target.vocab_size == 300
    assert console.export_text().splitlines() == [f"target: {tmp_path / 'tiny'} · cpu · float32", "draft: n-gram lookup"]


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_load_choice_says_why_int8_runs_on_onednn_where_the_kernels_did_not_build(tmp_path, monkeypatch, quantization):
    """A machine without a C compiler: the kernels really fail to build (CC=false, a fresh home), int8 falls back to
    torch's oneDNN matmul, and one note says why and what to install; a float model needs no kernel and gets none."""
    from rich.console import Console

    from specdec_cli.models.native import binding
    from tests.tiny import build_tiny_model

    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(binding, "library", binding.load_library)  # built anew, not the process's cached one
    build_tiny_model(tmp_path / "tiny")
    console = Console(record=True, width=400)
    target, _ = load_choice(choose(target=str(tmp_path / "tiny"), device="cpu", dtype="float32",
                                   target_quant=quantization), console)
    assert target.quantization == (None if quantization == "none" else quantization)
    notes = [line for line in console.export_text().splitlines() if line.startswith("note:")]
    expected = ("note: specdec's matmul kernels (int8, q4) did not build (false failed: no output), so int8 runs on "
                "torch's oneDNN matmul, several times slower, and q4 cannot run — install a C compiler (gcc) or set "
                "CC to one, then start again")
    assert notes == ([expected] if quantization == "int8" else [])


def _command_app():
    """A command declared with the shared options, as chat/run/compare do."""
    import typer

    from specdec_cli.cli import options
    from specdec_cli.cli.app import report_errors

    app = typer.Typer()

    @app.command()
    @report_errors
    def load(
        profile: options.ProfileOption = None,
        target: options.TargetOption = None,
        draft: options.DraftOption = None,
        drafter: options.DrafterOption = None,
        device: options.DeviceOption = None,
        dtype: options.DtypeOption = None,
        target_4bit: options.Target4bitOption = False,
        draft_4bit: options.Draft4bitOption = False,
        load_in_4bit: options.LoadIn4bitOption = False,
        load_in_8bit: options.LoadIn8bitOption = False,
        trust_remote_code: options.TrustRemoteCodeOption = False,
        allow_pickle: options.AllowPickleOption = False,
    ) -> None:
        choice = choose_models(ModelOverrides(
            profile, target, draft, drafter, device, dtype, target_4bit, draft_4bit,
            load_in_4bit, load_in_8bit, trust_remote_code, allow_pickle,
        ))
        load_choice(choice)

    return app


def test_device_cuda_on_a_cpu_machine_is_one_line_and_exit_2(tmp_path):
    import torch
    from typer.testing import CliRunner

    from tests.tiny import build_tiny_model

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    build_tiny_model(tmp_path / "tiny")
    result = CliRunner().invoke(_command_app(), ["--target", str(tmp_path / "tiny"), "--device", "cuda"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: device 'cuda' asked for, but this machine has no CUDA GPU — use --device cpu or auto"


def test_the_shared_options_reach_the_loader(tmp_path):
    from typer.testing import CliRunner

    from tests.tiny import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    result = CliRunner().invoke(_command_app(), ["--target", str(tmp_path / "tiny"), "--device", "cpu", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert f"target: {tmp_path / 'tiny'} · cpu · float32" in result.stderr


def test_draft_int8_sets_the_draft_only_and_wins_over_load_in_4bit():
    choice = choose(profile="qwen2.5-7b", draft_int8=True, load_in_4bit=True)
    assert (choice.target_quantization, choice.draft_quantization) == ("4bit", "int8")


def test_no_draft_int8_drops_a_profiles_int8_draft(tmp_path, monkeypatch):
    from specdec_cli.profiles import Profile

    profile = Profile(name="p", target="org/big", draft="org/small", drafter="model", draft_quantization="int8")
    monkeypatch.setattr("specdec_cli.settings.load_profile", lambda name: profile)
    assert choose(profile="p").draft_quantization == "int8"
    assert choose(profile="p", draft_int8=False).draft_quantization is None


def test_draft_4bit_and_draft_int8_contradict():
    with pytest.raises(InputError, match="contradict"):
        choose(profile="qwen2.5-7b", draft_4bit=True, draft_int8=True)


def test_a_profiles_int8_draft_is_dropped_with_a_note_on_a_gpu(monkeypatch):
    import io

    import torch
    from rich.console import Console

    from specdec_cli import settings as options
    from specdec_cli.profiles import Profile

    profile = Profile(name="p", target="org/big", draft="org/small", drafter="model", draft_quantization="int8")
    monkeypatch.setattr(options, "load_profile", lambda name: profile)
    monkeypatch.setattr(options, "resolve_device", lambda device: torch.device("cuda"))
    loaded = {}
    monkeypatch.setattr(options, "load_pair", lambda *args, **kwargs: loaded.update(kwargs) or (_Named(), _Named()))
    out = io.StringIO()
    options.load_choice(choose(profile="p"), Console(file=out))
    assert loaded["draft_quantization"] is None
    assert "int8 draft runs on the CPU only" in out.getvalue()
    options.load_choice(choose(profile="p", draft_int8=True), Console(file=io.StringIO()))
    assert loaded["draft_quantization"] == "int8"  # asked for explicitly: the loader refuses it with a hint


class _Named:
    device, quantization = torch.device("cuda"), None  # what load_choice reads besides (--prefill: not for it)

    def describe(self, role):
        return role


@pytest.mark.parametrize(("top_k", "kept"), [(None, 20), (-1, 0), (0, 0), (5, 5)])
def test_top_k_minus_one_is_every_token_as_in_vllm(top_k, kept):
    """A vLLM user's --top-k -1 (its 'every token') was refused; -2 still is."""
    from specdec_cli.settings import decoding_settings

    profile = choose().profile
    assert decoding_settings(profile, top_k=top_k).top_k == kept


def test_top_k_below_minus_one_is_refused():
    from specdec_cli.settings import decoding_settings

    with pytest.raises(InputError, match="top_k must be >= 0, got -2"):
        decoding_settings(choose().profile, top_k=-2)
