"""--target-quant / --draft-quant on the commands, and `specdec calibrate`, on the tiny pair."""

import json

import pytest
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.errors import InputError, ModelLoadError
from specdec_cli.models.native import binding
from specdec_cli.settings import ModelOverrides, choose_models
from tests.cli_result import assert_exited

WIDE = {"COLUMNS": "200"}


@pytest.fixture(autouse=True)
def an_idle_machine(monkeypatch):
    """calibrate refuses to time while other processes use the CPU (tested below): these tests are about formats,
    and a test machine's background (a Ray worker a test left) is not theirs to judge."""
    from specdec_cli.models import device

    monkeypatch.setattr(device, "others_cpu_use", lambda seconds=0.5: 0.0)
    monkeypatch.setattr(device.CpuUse, "others_since", lambda self, earlier: 0.0)


def choose(**flags):
    return choose_models(ModelOverrides(**flags))


def test_quant_flags_set_each_model_and_win_over_the_profile():
    choice = choose(target_quant="int8", draft_quant="int4")
    assert (choice.target_quantization, choice.draft_quantization) == ("int8", "int4")
    assert choose(draft_quant="none").draft_quantization == "none"  # the demo profile's auto draft overridden
    assert choose().draft_quantization == "auto"


@pytest.mark.parametrize(("flags", "complaint"), [
    ({"target_quant": "int8", "target_4bit": True}, "--target-quant and an older quantisation flag"),
    ({"draft_quant": "int4", "draft_int8": True}, "--draft-quant and an older quantisation flag"),
    ({"target_quant": "int8", "load_in_8bit": True}, "--target-quant and an older quantisation flag"),
])
def test_a_quant_flag_beside_an_old_alias_is_refused(flags, complaint):
    with pytest.raises(InputError, match=complaint):
        choose(**flags)


def test_an_unknown_format_names_the_known_ones():
    with pytest.raises(ModelLoadError, match="unknown quantization 'int3'") as error:
        choose(target_quant="int3")
    assert "none, int8, int4, q4, nf4, bnb8, auto" in error.value.one_line()


def test_run_with_an_int8_target_writes_records_naming_nothing_new(tiny_pair, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n")
    result = CliRunner().invoke(app, [
        "run", str(source), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair.target, "--draft", tiny_pair.draft,
        "--dtype", "float32", "-n", "6", "-t", "0", "--target-quant", "int8", "--draft-quant", "int8",
    ], env=WIDE)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, result.output
    assert "int8 weights, per-token int8 activations" in result.output  # the target's line names its precision
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert record["finish_reason"] in ("stop", "length") and record["completion_tokens"] >= 1


@pytest.mark.parametrize(("flags", "notes"), [
    (["--target-quant", "int4", "--dtype", "float32"],
     ["note: the target computes in bfloat16, not the float32 asked for: int4 always computes in bfloat16"]),
    (["--draft-quant", "int8", "--dtype", "bfloat16", "--target-quant", "none"],  # float asked for: no format hint
     ["note: the draft computes in float32, not the bfloat16 asked for: int8 always computes in float32"]),
    (["--target-quant", "int8", "--dtype", "float32"], []),  # honoured: nothing to say
])
def test_run_notes_a_dtype_a_format_does_not_honour(tiny_pair, tmp_path, flags, notes):
    """--target-quant int4 --dtype float32 ran in bfloat16, and only the target's line said so."""
    pytest.importorskip("torchao")
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "def add(a, b):"}) + "\n")
    result = CliRunner().invoke(app, [
        "run", str(source), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair.target, "--draft", tiny_pair.draft,
        "-n", "4", "-t", "0", *flags,
    ], env=WIDE)
    assert_exited(result, 0)
    assert [line for line in result.stderr.splitlines() if line.startswith("note:")] == notes


def test_run_with_an_unknown_format_is_one_line_and_exit_2(tiny_pair, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "x"}) + "\n")
    result = CliRunner().invoke(app, ["run", str(source), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair.target,
                                      "--target-quant", "int3"], env=WIDE)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2
    assert "unknown quantization 'int3'" in result.output
    assert not (tmp_path / "out.jsonl").exists()


def test_calibrate_measures_each_format_and_stores_it(tiny_pair, tmp_path, monkeypatch):
    profiles = tmp_path / "home" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "tiny.toml").write_text(f'target = "{tiny_pair.target}"\ndraft = "{tiny_pair.draft}"\ndrafter = "model"\n')
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "costs.json"
    result = CliRunner().invoke(app, [
        "calibrate", "--profile", "tiny", "--target-formats", "none,int8", "--draft-formats", "int8",
        "--dtype", "float32", "--repeats", "1", "--context", "8", "--json", str(out),
    ], env=WIDE)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, result.output
    stored = json.loads(out.read_text())
    assert [(entry["role"], entry["quantization"]) for entry in stored["entries"]] == [
        ("target", "none"), ("target", "int8"), ("draft", "int8")]
    assert all(set(entry["seconds"]) == {"1", "2", "4", "8", "16"} for entry in stored["entries"])
    assert json.loads((tmp_path / "home" / "calibration.json").read_text())["entries"] == stored["entries"]
    assert "n=16" in result.output


def test_calibrate_says_and_stores_how_the_q4_matmul_takes_its_blocks(tiny_pair, tmp_path, monkeypatch):
    if binding.library()[2] is not None:
        pytest.skip(binding.library()[2])
    profiles = tmp_path / "home" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "tiny.toml").write_text(f'target = "{tiny_pair.target}"\ndraft = "{tiny_pair.draft}"\ndrafter = "model"\n')
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    before = binding.q4_pairs()
    try:
        result = CliRunner().invoke(app, ["calibrate", "--profile", "tiny", "--target-formats", "q4", "--draft-formats",
                                          "q4", "--dtype", "float32", "--repeats", "1", "--context", "8"], env=WIDE)
    finally:
        binding.pair_q4_blocks(before)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, result.output
    pairs = json.loads((tmp_path / "home" / "calibration.json").read_text())["q4_pairs"]
    assert pairs["model"] == tiny_pair.target and pairs["isa"] == binding.library()[1]
    said = (f"two at a time up to {pairs['up_to_tokens']} tokens" if pairs["up_to_tokens"]
            else "one at a time (two at a time was not faster here)")
    said = f"q4 matmul: weight blocks {said}; {tiny_pair.target} with / without pairs"
    assert said in " ".join(result.output.split())


def test_a_calibration_of_a_few_formats_adds_to_the_one_stored_and_says_what_it_kept(tiny_pair, tmp_path, monkeypatch):
    """It replaced it: timing one more format lost every format timed before (what `auto` and the cost curves read)."""
    profiles = tmp_path / "home" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "tiny.toml").write_text(f'target = "{tiny_pair.target}"\ndraft = "{tiny_pair.draft}"\ndrafter = "model"\n')
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    common = ["calibrate", "--profile", "tiny", "--dtype", "float32", "--repeats", "1", "--context", "8"]
    first = CliRunner().invoke(app, [*common, "--target-formats", "none,int8", "--draft-formats", "int8"], env=WIDE)
    assert first.exit_code == 0, first.output
    before = json.loads((tmp_path / "home" / "calibration.json").read_text())
    second = CliRunner().invoke(app, [*common, "--target-formats", "int8", "--draft-formats", "none",
                                      "--json", str(tmp_path / "now.json")], env=WIDE)
    assert second.exit_code == 0, second.output
    assert "kept from the calibration before (not timed again now): target none, draft int8" in second.stderr
    stored = json.loads((tmp_path / "home" / "calibration.json").read_text())
    assert [(entry["role"], entry["quantization"]) for entry in stored["entries"]] == [
        ("target", "none"), ("draft", "int8"), ("target", "int8"), ("draft", "none")]
    assert stored["entries"][0]["seconds"] == before["entries"][0]["seconds"]  # as timed the first time
    assert stored["entries"][0]["measured_at"] == before["measured_at"]
    now = json.loads((tmp_path / "now.json").read_text())  # --json: what this run measured
    assert [(entry["role"], entry["quantization"]) for entry in now["entries"]] == [("target", "int8"), ("draft", "none")]


def test_calibrate_refuses_auto_and_unknown_formats_in_one_line():
    for formats, complaint in (("auto", "cannot hold auto"), ("int3", "unknown quantization")):
        result = CliRunner().invoke(app, ["calibrate", "--target-formats", formats], env=WIDE)
        assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.output
        assert complaint in result.output


def test_run_stores_the_formats_auto_resolved_to_not_auto(tiny_pair, tmp_path, specdec_home):
    from specdec_cli.settings import resolve_formats

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello"}\n')
    result = CliRunner().invoke(app, [
        "run", str(prompts), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair.target, "--draft", tiny_pair.same,
        "--device", "cpu", "--dtype", "float32", "-n", "4", "-t", "0", "--target-quant", "auto", "--draft-quant", "auto",
    ])
    assert result.exit_code == 0, result.output
    stored = json.loads((tmp_path / "out.jsonl.settings.json").read_text())["settings"]
    draft_default = "q4" if binding.library()[1] >= 2 else "int8"  # no calibration: by the CPU's kind
    assert (stored["target_quantization"], stored["draft_quantization"]) == ("int8", draft_default)
    choice = choose_models(ModelOverrides(target="t", draft="d", target_quant="auto", draft_quant="none", device="cpu"))
    assert (resolve_formats(choice).target_quantization, resolve_formats(choice).draft_quantization) == ("int8", "none")


def test_calibrate_skips_a_default_format_it_cannot_run_but_refuses_one_asked_for(tiny_pair, tmp_path, monkeypatch):
    import sys

    profiles = tmp_path / "home" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "tiny.toml").write_text(f'target = "{tiny_pair.target}"\n')
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if the quant extra were not installed
    common = ["calibrate", "--profile", "tiny", "--dtype", "float32", "--repeats", "1", "--context", "8"]
    result = CliRunner().invoke(app, common, env=WIDE)
    assert result.exit_code == 0, result.output
    assert "note: int4 skipped: int4 needs torchao, which is not installed — pip install 'specdec[quant]'" in result.output
    stored = json.loads((tmp_path / "home" / "calibration.json").read_text())
    assert [entry["quantization"] for entry in stored["entries"]] == ["none", "int8", "q4"]
    asked = CliRunner().invoke(app, [*common, "--target-formats", "int8,int4"], env=WIDE)
    assert isinstance(asked.exception, SystemExit) and asked.exit_code == 2, asked.output
    assert "int4 needs torchao" in asked.output


@pytest.mark.parametrize("file", ["home", "home/profiles"])
def test_calibrate_with_a_home_or_profiles_folder_that_is_a_file_says_so(tmp_path, monkeypatch, file):
    """A SPECDEC_HOME set to a file said "unknown profile 'tiny'" (its profiles folder cannot be read)."""
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text("not a folder\n")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, ["calibrate", "--profile", "tiny", "--target-formats", "none"], env=WIDE)
    assert_exited(result, 2)
    said = {"home": f"the specdec home {tmp_path / 'home'} is not a folder, so no profile of yours can be read from "
                    "it — set SPECDEC_HOME to a folder",
            "home/profiles": f"{tmp_path / 'home' / 'profiles'} is not a folder, so no profile of yours can be read "
                             "from it — move that file away: your profiles go in a folder of that name"}
    assert result.stderr == f"error: {said[file]}\n"


def test_calibrate_refuses_to_time_while_other_processes_use_the_cpu(tiny_pair, tmp_path, monkeypatch):
    """A calibration taken beside a `specdec run` in another terminal was stored as this machine's costs: `auto` and
    the draft policy read it until the next calibration. Refused before any model loads; --allow-busy times anyway."""
    from specdec_cli.models import calibrate, device

    profiles = tmp_path / "home" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "tiny.toml").write_text(f'target = "{tiny_pair.target}"\n')
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(device, "others_cpu_use", lambda seconds=0.5: 1.3)
    monkeypatch.setattr(device, "busy_cores", lambda: 0.5)  # a 2-core machine's (the test may run on a larger one)
    real_load = calibrate.load_model
    monkeypatch.setattr(calibrate, "load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))
    common = ["calibrate", "--profile", "tiny", "--target-formats", "none", "--dtype", "float32", "--repeats", "1",
              "--context", "8"]
    refused = CliRunner().invoke(app, common, env=WIDE)
    assert isinstance(refused.exception, SystemExit) and refused.exit_code == 2, refused.output
    assert refused.stderr.startswith("error: other processes are using 1.3 of this machine's")
    assert refused.stderr.rstrip().endswith("--allow-busy calibrates anyway") and len(refused.stderr.splitlines()) == 1
    assert not (tmp_path / "home" / "calibration.json").exists()
    monkeypatch.setattr(calibrate, "load_model", real_load)
    allowed = CliRunner().invoke(app, [*common, "--allow-busy"], env=WIDE)
    assert allowed.exit_code == 0, allowed.output
    assert (tmp_path / "home" / "calibration.json").exists()


def test_calibrate_does_not_store_what_it_timed_while_other_processes_took_the_cpu(tiny_pair, tmp_path, monkeypatch):
    """A job started after calibrate's first look (a `run` in another terminal) was in every figure stored."""
    from specdec_cli.models import device

    profiles = tmp_path / "home" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "tiny.toml").write_text(f'target = "{tiny_pair.target}"\n')
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(device.CpuUse, "others_since", lambda self, earlier: 0.9)
    monkeypatch.setattr(device, "busy_cores", lambda: 0.5)
    common = ["calibrate", "--profile", "tiny", "--target-formats", "none", "--dtype", "float32", "--repeats", "1",
              "--context", "8"]
    refused = CliRunner().invoke(app, common, env=WIDE)
    assert isinstance(refused.exception, SystemExit) and refused.exit_code == 2, refused.output
    assert "n=16" in refused.stdout  # the figures are shown
    assert refused.stderr.splitlines()[-1] == (
        "error: other processes used 0.9 cores on average while this timed: the figures above include them, so they "
        "were not stored — calibrate again on an idle machine; --allow-busy stores them anyway")
    assert not (tmp_path / "home" / "calibration.json").exists()
    allowed = CliRunner().invoke(app, [*common, "--allow-busy"], env=WIDE)
    assert allowed.exit_code == 0, allowed.output
    assert (tmp_path / "home" / "calibration.json").exists()


def test_a_kernel_choice_that_is_none_of_the_known_ones_is_one_line_and_exit_2(tiny_pair, tmp_path, monkeypatch):
    """SPECDEC_INT8_KERNEL=avx-2 ran the default code: the user then timed another kernel than they meant to."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "x"}) + "\n")
    monkeypatch.setenv("SPECDEC_INT8_KERNEL", "avx-2")
    binding.library.cache_clear()  # the library loads again, and reads the variable, in this run
    try:
        result = CliRunner().invoke(app, ["run", str(source), "-o", str(tmp_path / "out.jsonl"), "--target",
                                          tiny_pair.target, "--dtype", "float32", "--target-quant", "int8"], env=WIDE)
    finally:
        monkeypatch.delenv("SPECDEC_INT8_KERNEL")
        binding.library.cache_clear()
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.exception
    assert result.stderr == ("error: SPECDEC_INT8_KERNEL='avx-2' is not one of onednn, avx2, vnni — unset it to run "
                             "the code this CPU is best at\n")
    assert not (tmp_path / "out.jsonl").exists()
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)  # the newer name wins over SPECDEC_INT8_KERNEL
    _, best, problem = binding.load_library()  # unset: the CPU's best ISA (3 AMX, 2 AVX512-VNNI, 1 AVX2)
    honoured = {"onednn": (0, "SPECDEC_INT8_KERNEL=onednn")}  # the known ones, in any case and spacing, and unset
    honoured.update({"AVX2": (1, None), " vnni ": (min(best, 2), None), "": (best, None)} if problem is None else
                    {value: (0, problem) for value in ("AVX2", " vnni ", "")})  # no kernels here: none, and why
    for value, (isa, why) in honoured.items():
        monkeypatch.setenv("SPECDEC_INT8_KERNEL", value)
        loaded, chosen_isa, chosen_problem = binding.load_library()
        assert (chosen_isa, chosen_problem, loaded is None) == (isa, why, why is not None), value


@pytest.mark.parametrize(("json_path", "says"), [
    ("{tmp}/no/such/folder/costs.json", "no folder {tmp}/no/such/folder for --json — create it or choose another path"),
    ("{tmp}/notes.md", "{tmp}/notes.md exists and is not a specdec calibrate result: --json would replace it — give "
                       "--json a new file name, or remove that file first"),
    ("{tmp}", "{tmp} is a folder — give --json a file name"),
])
def test_calibrate_refuses_a_json_path_it_could_not_write_before_it_times_anything(tiny_pair, tmp_path, monkeypatch,
                                                                                     json_path, says):
    """A --json in a folder that does not exist was found only after minutes of timing, and the calibration was
    lost with it (the file named by the user is written first); a typo naming another file would replace it."""
    from specdec_cli.models import calibrate

    (tmp_path / "notes.md").write_text("mine\n")
    monkeypatch.setattr(calibrate, "measure_forward_costs", lambda *args, **kwargs: pytest.fail("timed first"))
    result = CliRunner().invoke(app, ["calibrate", "--profile", "demo", "--json", json_path.format(tmp=tmp_path)],
                                env=WIDE)
    assert_exited(result, 2)
    assert result.stderr == f"error: {says.format(tmp=tmp_path)}\n"
    assert (tmp_path / "notes.md").read_text() == "mine\n"


def test_calibrate_json_may_replace_its_own_earlier_result(tiny_pair, tmp_path, monkeypatch):
    profiles = tmp_path / "home" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "tiny.toml").write_text(f'target = "{tiny_pair.target}"\ndraft = "{tiny_pair.draft}"\ndrafter = "model"\n')
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    common = ["calibrate", "--profile", "tiny", "--dtype", "float32", "--repeats", "1", "--context", "8",
              "--target-formats", "none", "--draft-formats", "none", "--json", str(tmp_path / "costs.json")]
    result = CliRunner().invoke(app, common, env=WIDE)
    assert_exited(result, 0)
    first = json.loads((tmp_path / "costs.json").read_text())
    assert {"machine", "entries"} <= first.keys() and first["entries"]
    (tmp_path / "costs.json").write_text(json.dumps({**first, "entries": [], "earlier": True}))  # marked as the old one
    result = CliRunner().invoke(app, common, env=WIDE)
    assert_exited(result, 0)
    second = json.loads((tmp_path / "costs.json").read_text())
    assert "earlier" not in second and second["entries"]  # replaced by the new result, not refused or merged
    assert second.keys() == first.keys()
