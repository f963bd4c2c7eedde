import json

import psutil
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdec_cli.errors import IncompatibleModelsError, InsufficientMemoryError
from specdec_cli.models import check_tokenizers_compatible, estimate_weight_bytes, load_pair
from specdec_cli.models.loading import loaded as loaded_module
from specdec_cli.models.loading import preflight

GIB = 1024**3


def _tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


def _forbid_weight_loading(monkeypatch):
    def must_not_load(*args):
        raise AssertionError("weights were loaded before the pre-flight refused")

    monkeypatch.setattr(loaded_module, "_load_weights", must_not_load)


def test_a_padded_vocabulary_pair_loads(qwen2_padded_folder, llama_folder):
    target, draft = load_pair(str(qwen2_padded_folder), str(llama_folder), device="cpu", dtype="float32", progress=False)
    assert (target.vocab_size, draft.vocab_size) == (320, 300)
    assert target.eos_token_ids == draft.eos_token_ids


def _copy_of(folder, destination):
    import shutil

    shutil.copytree(folder, destination)
    return destination


def test_a_draft_with_the_targets_tokenizer_files_shares_its_tokenizer(llama_folder, tmp_path):
    """As the demo pair: the same tokenizer files, another chat template (which the draft never applies)."""
    draft = _copy_of(llama_folder, tmp_path / "draft")
    (draft / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    target, loaded_draft = load_pair(str(llama_folder), str(draft), device="cpu", progress=False)
    assert loaded_draft.tokenizer is target.tokenizer


def test_a_draft_whose_tokenizer_files_differ_loads_its_own(llama_folder, tmp_path):
    import json

    draft = _copy_of(llama_folder, tmp_path / "draft")
    config = json.loads((draft / "tokenizer_config.json").read_text())
    (draft / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 12345}))
    target, loaded_draft = load_pair(str(llama_folder), str(draft), device="cpu", progress=False)
    assert loaded_draft.tokenizer is not target.tokenizer
    assert loaded_draft.tokenizer.model_max_length == 12345 != target.tokenizer.model_max_length


def test_without_a_draft_only_the_target_loads(llama_folder):
    target, draft = load_pair(str(llama_folder), None, device="cpu", progress=False)
    assert draft is None and target.vocab_size == 300


def test_a_draft_of_another_tokenizer_loads_with_its_overlap_said_before_weights_load(llama_folder,
                                                                                      other_tokenizer_folder,
                                                                                      monkeypatch):
    """Allowed (it drafts text: drafters/cross_vocab.py), with one line saying how much of the target's vocabulary
    the draft's has, before any weights load."""
    said = []
    real = loaded_module._load_weights
    monkeypatch.setattr(loaded_module, "_load_weights", lambda *args: said.append("weights") or real(*args))
    target, draft = load_pair(str(llama_folder), str(other_tokenizer_folder), device="cpu", progress=False,
                              say=said.append)
    shares = preflight.vocabulary_shares(target.tokenizer, draft.tokenizer)
    assert draft.vocabulary_overlap == shares[0] and target.vocabulary_overlap is None
    assert said == [preflight.cross_vocabulary_line(shares, str(llama_folder), str(other_tokenizer_folder)),
                    "weights", "weights"]
    assert said[0].startswith(f"note: the draft {other_tokenizer_folder} has another tokenizer than the target "
                              f"{llama_folder}: it has 79% of the target's tokens")  # trained on other text, same bytes


def test_the_overlap_counts_token_strings_as_text():
    """A byte-level BPE's Ġ / Ċ / byte characters and SentencePiece's ▁ and <0xNN> read as the text they stand for;
    special and added tokens and parts of a character left out."""
    from types import SimpleNamespace

    from tokenizers import decoders

    def tokenizer(vocab, added, decoder):
        return SimpleNamespace(get_vocab=lambda: {token: i for i, token in enumerate(vocab + added)},
                               get_added_vocab=lambda: {token: i for i, token in enumerate(added)},
                               backend_tokenizer=SimpleNamespace(decoder=decoder))

    byte_level = tokenizer(["Ġthe", "the", "Ġdog", "ĊĊ", "Ã©", "Ã"], ["<|im_end|>"], decoders.ByteLevel())
    sentencepiece = tokenizer(["▁the", "the", "<0x0A>", "é", "▁cat", "▁sat", "▁mat", "▁on", "<0xC3>"],
                              ["<s>", "<|im_end|>"],
                              decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()]))
    # The target's whole-character tokens: " the", "the", " dog", "\n\n", "é"; the draft has " the", "the", "é".
    # The draft's: " the", "the", "\n", "é", " cat", " sat", " mat", " on"; the target has " the", "the", "é".
    assert preflight.vocabulary_shares(byte_level, sentencepiece) == pytest.approx((3 / 5, 3 / 8))
    assert preflight.vocabulary_overlap(byte_level, sentencepiece) == pytest.approx(3 / 5)
    assert preflight.vocabulary_shares(sentencepiece, byte_level) == pytest.approx((3 / 8, 3 / 5))


@pytest.mark.parametrize("shares, opening", [((0.26, 0.3), "warning: "), ((0.26, 0.8), "note: "), ((0.5, 0.1), "note: ")])
def test_the_line_warns_only_when_even_the_smaller_vocabulary_shares_little(shares, opening):
    """A small draft vocabulary holds little of a large target's (SmolLM2's 49,152 tokens: 26% of Qwen2.5's 151,643,
    and 80% of its own are Qwen's) and drafts well enough: the smaller side's share decides the warning."""
    line = preflight.cross_vocabulary_line(shares, "big", "small")
    assert line.startswith(f"{opening}the draft small has another tokenizer than the target big: it has "
                           f"{shares[0]:.0%} of the target's tokens, and the target {shares[1]:.0%} of its own; it "
                           "drafts text, which the target verifies as its own tokens (lossless)")
    assert ("little of it may be accepted" in line) == (max(shares) < preflight.LOW_OVERLAP)
    assert "\n" not in line


def test_different_special_tokens_are_refused(llama_folder):
    target_tokenizer, draft_tokenizer = _tokenizer(llama_folder), _tokenizer(llama_folder)
    draft_tokenizer.eos_token = "<|endoftext|>"
    with pytest.raises(IncompatibleModelsError, match="their eos tokens differ"):
        check_tokenizers_compatible(target_tokenizer, draft_tokenizer, "big", "small")


def test_a_pad_token_defined_on_one_side_only_passes(llama_folder):
    target_tokenizer, draft_tokenizer = _tokenizer(llama_folder), _tokenizer(llama_folder)
    draft_tokenizer.pad_token = None
    check_tokenizers_compatible(target_tokenizer, draft_tokenizer, "big", "small")
    draft_tokenizer.pad_token = "<|im_start|>"
    with pytest.raises(IncompatibleModelsError, match="their pad tokens differ"):
        check_tokenizers_compatible(target_tokenizer, draft_tokenizer, "big", "small")


def test_identical_tokenizers_pass(llama_folder, qwen2_padded_folder):
    check_tokenizers_compatible(_tokenizer(qwen2_padded_folder), _tokenizer(llama_folder), "big", "small")


def _free_ram(monkeypatch, available: int):
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=available))


def test_weights_that_do_not_fit_are_refused_before_loading(llama_folder, qwen2_padded_folder, monkeypatch):
    _forbid_weight_loading(monkeypatch)
    _free_ram(monkeypatch, 100 * 1024**2)
    with pytest.raises(InsufficientMemoryError) as raised:
        load_pair(str(qwen2_padded_folder), str(llama_folder), device="cpu", progress=False)
    line = raised.value.one_line()
    assert "only 0.1 GiB of RAM is free" in line
    assert "--load-in-4bit" in line


def test_weights_that_fit_pass_the_memory_check(llama_folder, monkeypatch):
    _free_ram(monkeypatch, 2 * GIB)
    target, _ = load_pair(str(llama_folder), None, device="cpu", progress=False)
    assert target.vocab_size == 300


def test_weight_estimate_of_a_tiny_model_is_exact(llama_folder):
    config = AutoConfig.from_pretrained(llama_folder)
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(llama_folder).parameters())
    assert estimate_weight_bytes(config, torch.bfloat16, None) == 2 * parameters
    assert estimate_weight_bytes(config, torch.float32, None) == 4 * parameters


def test_quantisation_shrinks_only_the_linear_layers(llama_folder):
    config = AutoConfig.from_pretrained(llama_folder)
    embeddings_and_head = 2 * 300 * 64
    bf16 = estimate_weight_bytes(config, torch.bfloat16, None)
    eight = estimate_weight_bytes(config, torch.bfloat16, "8bit")
    four = estimate_weight_bytes(config, torch.bfloat16, "4bit")
    assert 2 * embeddings_and_head < four < eight < bf16


def test_weight_estimate_of_a_7b_config():
    from transformers import Qwen2Config

    # Qwen2.5-7B-Instruct's shape: 7.62 B parameters.
    config = Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    )
    assert 15.0e9 < estimate_weight_bytes(config, torch.bfloat16, None) < 15.5e9
    # embeddings and output layer stay bf16 (2.2 GB); 6.5 B linear weights at ~4.25 bits (3.5 GB)
    assert 5.3e9 < estimate_weight_bytes(config, torch.bfloat16, "4bit") < 6.0e9


def test_a_local_config_s_estimate_is_kept_and_read_back_without_building_the_model(llama_folder, specdec_home,
                                                                                   monkeypatch):
    """`profiles list` built every local model on the meta device each time (~4 s of its ~6 on the demo pair)."""
    from specdec_cli.models.loading import preflight

    made = preflight.estimate_local_weight_bytes(str(llama_folder), torch.bfloat16, "q4")
    assert made == estimate_weight_bytes(AutoConfig.from_pretrained(llama_folder), torch.bfloat16, "q4")
    assert (specdec_home / preflight.ESTIMATES).is_file()

    def must_not_build(*args):
        raise AssertionError("the kept estimate was not used")

    monkeypatch.setattr(preflight, "estimate_weight_bytes", must_not_build)
    assert preflight.estimate_local_weight_bytes(str(llama_folder), torch.bfloat16, "q4") == made


def test_a_changed_config_is_estimated_anew(llama_folder, tmp_path):
    """The estimate is kept by the config's bytes, not its folder: a model replaced in place gets its own figure."""
    import shutil

    from specdec_cli.models.loading import preflight

    folder = tmp_path / "model"
    shutil.copytree(llama_folder, folder)
    before = preflight.estimate_local_weight_bytes(str(folder), torch.bfloat16, None)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] += 2
    (folder / "config.json").write_text(json.dumps(config))
    after = preflight.estimate_local_weight_bytes(str(folder), torch.bfloat16, None)
    assert after == estimate_weight_bytes(AutoConfig.from_pretrained(folder), torch.bfloat16, None) > before


@pytest.mark.parametrize("damage", ["garbage", "a list", "a home that is a file"])
def test_a_damaged_or_unwritable_store_still_gives_the_estimate(llama_folder, specdec_home, monkeypatch, damage):
    from specdec_cli.models.loading import preflight

    expected = estimate_weight_bytes(AutoConfig.from_pretrained(llama_folder), torch.bfloat16, "int8")
    specdec_home.mkdir(parents=True, exist_ok=True)
    store = specdec_home / preflight.ESTIMATES
    if damage == "a home that is a file":
        monkeypatch.setenv("SPECDEC_HOME", str(store))
        store.write_text("not a folder")
    else:
        store.write_text("{not json" if damage == "garbage" else "[1, 2]")
    assert preflight.estimate_local_weight_bytes(str(llama_folder), torch.bfloat16, "int8") == expected
    if damage != "a home that is a file":  # made whole again
        assert list(json.loads(store.read_text()).values()) == [expected]
    assert not [path for path in specdec_home.iterdir() if path.name.startswith(f".{preflight.ESTIMATES}")]
