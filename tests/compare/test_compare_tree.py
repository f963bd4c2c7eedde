"""`specdec compare --drafter tree` with tree sizes, on tiny saved models; its usage errors."""

from tests.compare.test_compare_command import invoke, spec_bench_file, table_rows


def test_tree_configurations_run_and_match_the_target(tiny_pair, tmp_path):
    result = invoke(
        "--target", tiny_pair.target, "--draft", tiny_pair.draft, "--dtype", "float32", "--device", "cpu",
        "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--category", "coding", "--n-prompts", "1",
        "--drafter", "model,tree", "--tree-size", "4,8", "--k", "3", "--max-new-tokens", "8",
        env={"SPECDEC_HOME": str(tmp_path / "home")},
    )
    assert result.exit_code == 0 and result.exception is None, result.output
    rows = table_rows(result.stdout)
    assert [row[0] for row in rows[:4]] == ["target alone", "model k=3", "tree4 k=3", "tree8 k=3"]
    assert all(row[-1] == "1/1" for row in rows[:4])  # greedy: every output equals the baseline's
    # The chain's theory table, then the trees' (expected accepted length from their own per-place acceptance).
    assert "tree theory: expected = (1 + E[accepted]) / (c + 1)" in result.stdout
    assert [row[0] for row in rows[4:]] == ["model k=3", "tree4 k=3", "tree8 k=3"]


def test_tree_size_without_the_tree_drafter_is_refused(tiny_pair, tmp_path):
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.draft, "--drafter", "model",
                    "--tree-size", "8", env={"SPECDEC_HOME": str(tmp_path / "home")})
    assert result.exit_code == 2 and "--tree-size needs --drafter tree" in result.output


def test_an_unknown_drafter_in_the_list_is_refused_before_any_model_loads(tiny_pair, tmp_path, monkeypatch):
    def load_choice(*args, **kwargs):
        raise AssertionError("a model was loaded before the drafter list was checked")

    monkeypatch.setattr("specdec_cli.settings.load_choice", load_choice)  # what compare imports when it runs
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.draft, "--drafter", "model,forest",
                    env={"SPECDEC_HOME": str(tmp_path / "home")})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output  # no other exception
    assert "unknown drafter 'forest'" in result.output and "model, ngram, cascade, tree" in result.output


def test_a_bad_tree_size_is_refused(tiny_pair, tmp_path):
    result = invoke("--target", tiny_pair.target, "--draft", tiny_pair.draft, "--drafter", "tree",
                    "--tree-size", "8,x", env={"SPECDEC_HOME": str(tmp_path / "home")})
    assert result.exit_code == 2 and "not a list of node counts" in result.output


def test_a_model_without_tree_attention_drafts_chains_with_one_note(tiny_pair, tmp_path, monkeypatch):
    from specdec_cli import session

    monkeypatch.setattr(session, "tree_capable", lambda model: False)
    result = invoke(
        "--target", tiny_pair.target, "--draft", tiny_pair.draft, "--dtype", "float32", "--device", "cpu",
        "--prompts", spec_bench_file(tmp_path / "q.jsonl"), "--category", "coding", "--n-prompts", "1",
        "--drafter", "tree", "--k", "3", "--max-new-tokens", "8", env={"SPECDEC_HOME": str(tmp_path / "home")},
    )
    assert result.exit_code == 0 and result.exception is None, result.output
    notes = [line for line in result.stderr.splitlines() if "tree mask" in line]
    assert len(notes) == 1 and notes[0].startswith("note: the draft (sdpa attention) cannot take a tree mask")
    rows = table_rows(result.stdout)[:2]
    assert [row[0] for row in rows] == ["target alone", "tree16 k=3"]  # no calibration: the default size, named
    assert [row[-1] for row in rows] == ["1/1", "1/1"]
