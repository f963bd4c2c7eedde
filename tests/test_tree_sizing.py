"""How big a token tree is and whether there is one: the node budget from the target's measured
forward-cost curve (`specdec calibrate`), the default without one, and chains with a one-line note
where a model cannot take a tree mask."""

import copy
from types import SimpleNamespace

import pytest
import torch

from specdec_cli.drafters import DraftModelDrafter
from specdec_cli.drafters.cascade import CascadeDrafter
from specdec_cli.drafters.tree import DEFAULT_BUDGET, MIN_BUDGET, VALUE_BUDGET, TreeDrafter, budget_from_costs
from specdec_cli.models.formats.calibration import machine, save_calibration
from specdec_cli.session import AUTO_BRANCH_CUT, build_decoder, make_drafter, tree_budget_for, tree_note

from tests.tiny import tokenless_tokenizer

FLAT_TO_16 = {1: 0.100, 2: 0.101, 4: 0.104, 8: 0.110, 16: 0.118}


@pytest.mark.parametrize("seconds, nodes", [
    (FLAT_TO_16, 15),  # flat as far as measured: 16 tokens, one of them the sequence's last
    ({1: 0.1, 2: 0.1, 4: 0.105, 8: 0.11, 16: 0.15}, 9),  # x1.2 is reached at 8 + 8 * 0.01/0.04 = 10
    ({1: 0.1, 2: 0.11, 4: 0.13, 8: 0.2}, 2),  # x1.2 half way from 2 to 4 tokens: 3 tokens, 2 nodes
    ({8: 0.1, 1: 0.1, 4: 0.1}, 7),  # the order of the keys does not matter
    ({1: 0.086, 2: 0.105, 4: 0.089, 8: 0.113, 16: 0.163}, 5),  # measured (int8): a bump at 2 tokens, flat again at 4
])
def test_the_budget_is_the_nodes_a_verify_takes_while_it_stays_flat(seconds, nodes):
    assert budget_from_costs(seconds) == nodes


@pytest.mark.parametrize("seconds", [
    {1: 0.1, 2: 0.15, 4: 0.3},  # not flat even for two tokens
    {1: 0.058, 2: 0.069, 4: 0.0735, 8: 0.114, 16: 0.182},  # measured (q4, 2026-12-02): x1.2 just past 2 tokens
])
def test_a_curve_that_is_not_flat_gives_the_smallest_tree(seconds):
    assert budget_from_costs(seconds) == MIN_BUDGET


@pytest.mark.parametrize("seconds", [
    {2: 0.1, 4: 0.1},             # no one-token cost to compare with
    {1: 0.1},                       # nothing past one token
    {},
])
def test_no_budget_from_a_curve_that_says_nothing(seconds):
    assert budget_from_costs(seconds) is None


def loaded(model, name="org/big", quantization=None):
    return SimpleNamespace(model=model, name=name, quantization=quantization, dtype=torch.float32,
                           tokenizer=tokenless_tokenizer(), eos_token_ids=(2,),
                           vocab_size=model.config.vocab_size, vocabulary_overlap=None)


def calibration(*entries):
    return {"machine": machine(), "entries": [{"role": role, "model": model, "quantization": quantization, "dtype": dtype,
                                        "seconds": seconds} for role, model, quantization, dtype, seconds in entries]}


def test_the_budget_comes_from_the_target_s_own_measurement_on_this_machine(llama_target):
    target = loaded(llama_target)
    assert tree_budget_for(target) == DEFAULT_BUDGET  # nothing measured yet
    flat = {1: 0.1, 2: 0.1, 4: 0.1, 8: 0.1}
    save_calibration(calibration(
        ("target", "org/big", "int8", "float32", flat),    # another format
        ("target", "org/big", "none", "bfloat16", flat),   # another dtype
        ("target", "org/other", "none", "float32", flat),  # another model
    ))
    assert tree_budget_for(target) == DEFAULT_BUDGET
    elsewhere = calibration(("target", "org/big", "none", "float32", flat)) | {"machine": {"cpu": "another CPU"}}
    save_calibration(elsewhere)
    assert tree_budget_for(target) == DEFAULT_BUDGET
    save_calibration(calibration(("draft", "org/big", "none", "float32", {1: 0.1, 2: 0.1, 4: 0.11, 8: 0.3})))
    assert tree_budget_for(target) == 3  # measured as a draft: the same model and format cost the same


def test_a_curve_that_is_not_flat_gives_the_smallest_tree_not_the_default(llama_target):
    save_calibration(calibration(("target", "org/big", "none", "float32", {1: 0.1, 2: 0.2, 4: 0.4})))
    assert tree_budget_for(loaded(llama_target)) == MIN_BUDGET


def test_the_tree_drafter_gets_the_calibrated_budget_unless_one_is_given(llama_target, llama_near_draft):
    save_calibration(calibration(("target", "org/big", "none", "float32", FLAT_TO_16)))
    target, draft = loaded(llama_target), loaded(llama_near_draft, name="org/small")
    assert make_drafter("tree", draft, 4, target).model_drafter.budget == 15
    assert make_drafter("tree", draft, 4, target, tree_budget=5).model_drafter.budget == 5
    assert build_decoder(target, draft, "tree", 4).drafter.model_drafter.budget == 15
    assert tree_note(target, draft) is None


def test_with_k_auto_the_tree_grows_by_value_within_a_cap_and_lookups_come_first(llama_target, llama_near_draft):
    save_calibration(calibration(("target", "org/big", "none", "float32", {1: 0.1, 2: 0.2, 4: 0.4})))
    target, draft = loaded(llama_target), loaded(llama_near_draft, name="org/small")
    drafter = build_decoder(target, draft, "tree", "auto").drafter
    assert isinstance(drafter, CascadeDrafter) and isinstance(drafter.model_drafter, TreeDrafter)
    tree = drafter.model_drafter
    assert tree.budget == VALUE_BUDGET  # not the curve's MIN_BUDGET: a cap, the odds decide the shape
    assert tree.rule is not None and tree.rule.branch_cut == AUTO_BRANCH_CUT
    assert make_drafter("tree", draft, "auto", target, tree_budget=6).model_drafter.budget == 6


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_model_without_tree_attention_drafts_chains_with_a_one_line_note(llama_target, llama_near_draft, role):
    models = {"target": copy.deepcopy(llama_target), "draft": copy.deepcopy(llama_near_draft)}
    models[role].config._attn_implementation = "flash_attention_2"
    target, draft = loaded(models["target"]), loaded(models["draft"], name="org/small")
    note = tree_note(target, draft)
    assert note.startswith(f"note: the {role} (flash_attention_2 attention) cannot take a tree mask") and "\n" not in note
    drafter = make_drafter("tree", draft, 4, target)
    assert isinstance(drafter, CascadeDrafter) and isinstance(drafter.model_drafter, DraftModelDrafter)
