import pytest
import torch

from specdec_cli.errors import ModelLoadError, ModelNotFoundError
from specdec_cli.models import LoadedModel, load_model
from specdec_cli.models.loading.loaded import eos_token_ids
from tests.tiny import build_tokenizer, tiny_config


def test_loads_a_folder_in_eval_mode_on_the_chosen_device(llama_folder):
    loaded = load_model(str(llama_folder), device="cpu", dtype="bfloat16", progress=False)
    assert isinstance(loaded, LoadedModel)
    assert loaded.name == str(llama_folder)
    assert loaded.source == str(llama_folder.resolve())
    assert (loaded.device, loaded.dtype, loaded.quantization) == (torch.device("cpu"), torch.bfloat16, None)
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert loaded.vocab_size == len(loaded.tokenizer) == 300
    logits = loaded.model(torch.tensor([[1, 2, 3]])).logits  # (B, T, V)
    assert logits.shape == (1, 3, 300)


def test_describe_is_one_line_naming_device_and_dtype(llama_folder):
    loaded = load_model(str(llama_folder), device="cpu", dtype="float32", progress=False)
    assert loaded.describe("target") == f"target: {llama_folder} · cpu · float32"


def test_padded_output_layer_sets_vocab_size(qwen2_padded_folder):
    loaded = load_model(str(qwen2_padded_folder), device="cpu", dtype="float32", progress=False)
    assert len(loaded.tokenizer) == 300
    assert loaded.vocab_size == 320


def test_eos_ids_are_the_union_of_generation_config_and_tokenizer():
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", 300, tokenizer))
    model.generation_config.eos_token_id = [0, 2]
    tokenizer.eos_token = "<|im_start|>"  # id 1
    assert eos_token_ids(model, tokenizer) == (0, 2, 1)


def _pickle_only_folder(source, destination):
    from transformers import AutoModelForCausalLM

    destination.mkdir()
    model = AutoModelForCausalLM.from_pretrained(source)
    model.config.save_pretrained(destination)
    build_tokenizer(destination)
    torch.save(model.state_dict(), destination / "pytorch_model.bin")


def test_pickle_weights_are_refused_unless_allowed(llama_folder, tmp_path):
    folder = tmp_path / "pickled"
    _pickle_only_folder(llama_folder, folder)
    with pytest.raises(ModelLoadError, match="has only pickle weights") as raised:
        load_model(str(folder), device="cpu", progress=False)
    assert "--allow-pickle" in raised.value.hint
    loaded = load_model(str(folder), device="cpu", dtype="float32", allow_pickle=True, progress=False)
    assert loaded.vocab_size == 300


def test_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="without a config.json"):
        load_model(str(tmp_path), progress=False)


@pytest.mark.parametrize(("files", "folder", "hint"), [
    (["model-Q4_K_M.gguf"], "downloads", "it holds model-Q4_K_M.gguf: pass {folder}/model-Q4_K_M.gguf"),
    (["a.gguf", "mmproj.gguf"], "downloads", "pass one of the .gguf files it holds: a.gguf, mmproj.gguf"),
    ([], "models--Qwen--Qwen2.5-7B-Instruct", "it is a Hugging Face cache entry: pass its hub id, Qwen/Qwen2.5-7B-Instruct"),
    (["notes.txt"], "downloads", "pass a folder saved with save_pretrained, a .gguf file or a hub id"),
])
def test_a_folder_that_is_not_a_model_says_what_to_pass_instead(tmp_path, files, folder, hint):
    """The folder llama.cpp's downloads went to, or a Hugging Face cache entry, was told what a model folder is."""
    path = tmp_path / folder
    path.mkdir()
    for name in files:
        (path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError) as raised:
        load_model(str(path), progress=False)
    assert raised.value.one_line() == f"{path} is a folder without a config.json — {hint.format(folder=path)}"


def test_a_folder_with_a_config_but_no_weights_says_so_before_any_memory_estimate(tmp_path, monkeypatch):
    """A config alone (a save interrupted, weights in another folder) was told that its default-sized model would not
    fit in memory (Qwen2's defaults: ~22 GiB), or loaded nothing only after the estimate."""
    from specdec_cli.models.loading import preflight

    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda device: 1)  # any estimate would be refused
    for quantization in (None, "q4"):
        with pytest.raises(ModelNotFoundError, match="has no weights"):
            load_model(str(tmp_path), device="cpu", quantization=quantization, progress=False)


@pytest.mark.parametrize(("config", "says"), [
    ('{"model_type": "qwen2", "num_attention_heads": 0}', "does not describe a model transformers can build: ZeroDiv"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 3}', "config of .*: The hidden size .64. is not"),
    ('{"model_type": "llama", "hidden_size": "big"}', "config of .*: Field 'hidden_size' expected int"),
])
def test_a_config_its_model_class_refuses_is_one_line(tmp_path, config, says):
    """transformers 5 validates a config's values (huggingface_hub's StrictDataclassError, not a ValueError) and the
    memory estimate builds the model from the config on the meta device (a head count of 0: the model class's own
    ZeroDivisionError): each was a traceback, exit 1."""
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=says) as raised:
        load_model(str(tmp_path), device="cpu", progress=False)
    assert "\n" not in raised.value.one_line()


def test_missing_path_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        load_model(str(tmp_path / "nope.gguf"), progress=False)


def test_a_string_that_is_nothing_is_model_not_found():
    with pytest.raises(ModelNotFoundError, match="not a file, folder, demo model or hub id"):
        load_model("not a model!", progress=False)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(path), progress=False)


def test_unknown_quantization_is_refused(llama_folder):
    with pytest.raises(ModelLoadError, match="unknown quantization '3bit'"):
        load_model(str(llama_folder), quantization="3bit", progress=False)


def test_the_session_adds_the_end_of_turn_tokens_a_vocabulary_has_and_no_unknown_token():
    from types import SimpleNamespace

    from specdec_cli.session import eos_token_ids as session_eos_ids
    from tests.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    model = SimpleNamespace(tokenizer=tokenizer, eos_token_ids=(7,))
    assert session_eos_ids(model) == tuple(sorted({7, ids["<|im_end|>"], ids["<|endoftext|>"]}))
    # a tokenizer with an unknown token answers its id for every token it lacks (<|eot_id|>, <end_of_turn>, ...)
    tokenizer.unk_token = "<|im_start|>"
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") == ids["<|im_start|>"]
    assert session_eos_ids(model) == tuple(sorted({7, ids["<|im_end|>"], ids["<|endoftext|>"]}))
