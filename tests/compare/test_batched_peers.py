"""HF's batched peers of `compare --batch-size` on a tiny saved model (fp32): padded generate and continuous
batching give what HF generate gives one prompt at a time, cut at EOS the same way."""

import pytest
import torch

from specdec_cli.bench.batched_peers import (
    PeerUnavailable, continuous_batching_settings, generate_batch, left_padded, padded_generate,
)
from specdec_cli.bench.peers import hf_generation_config
from specdec_cli.engine import SamplingParams, cut_at_eos
from specdec_cli.models import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Three lengths, so a batch of 2 pads one row by 7 tokens and the last batch holds one prompt.
PROMPTS = [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72]]
GREEDY = SamplingParams()
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair.target, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def int8_target(tiny_pair):
    return load_model(tiny_pair.target, device="cpu", dtype="float32", quantization="int8", progress=False)


def config(eos_ids, max_new_tokens=NEW_TOKENS, params=GREEDY):
    return hf_generation_config(params, max_new_tokens, eos_ids, pad_id=0, lookup=False)


def one_at_a_time(target, prompts, generation_config, eos_ids):
    """HF generate on each prompt alone (no padding): the reference."""
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        output = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config)
        outputs.append(cut_at_eos(output[0, len(prompt):].tolist(), eos_ids))
    return outputs


def test_left_padding_right_aligns_each_prompt_and_masks_the_pads():
    input_ids, mask = left_padded([[7, 8], [1, 2, 3, 4]], pad_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[0, 0, 7, 8], [1, 2, 3, 4]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_padded_generate_gives_each_prompt_what_generate_gives_it_alone(target, batch_size):
    eos_ids = target.eos_token_ids
    expected = one_at_a_time(target, PROMPTS, config(eos_ids), eos_ids)
    assert all(len(tokens) == NEW_TOKENS for tokens in expected)  # no early EOS: every position compared
    padded = padded_generate(target, PROMPTS, batch_size, config(eos_ids), GREEDY, pad_id=0)
    assert [cut_at_eos(tokens, eos_ids) for tokens in padded] == expected


def test_padded_rows_are_cut_at_their_own_eos(target):
    """A token one row emits mid-output made the EOS: that row stops after it, the others run on, and the
    padding HF puts after a finished row is cut away."""
    plain = one_at_a_time(target, PROMPTS, config(target.eos_token_ids), target.eos_token_ids)
    eos = plain[1][4]
    assert eos not in plain[0][:NEW_TOKENS]  # the other row would not stop
    expected = [tokens[: tokens.index(eos) + 1] if eos in tokens else tokens for tokens in plain]
    padded = padded_generate(target, PROMPTS, 3, config([eos]), GREEDY, pad_id=0)
    assert [cut_at_eos(tokens, [eos]) for tokens in padded] == expected


def test_generate_batch_runs_on_a_cpu_and_gives_plain_greedy(target):
    eos_ids = target.eos_token_ids
    expected = one_at_a_time(target, PROMPTS, config(eos_ids), eos_ids)
    batched = generate_batch(target, PROMPTS, 2, config(eos_ids), GREEDY)
    assert [cut_at_eos(tokens, eos_ids) for tokens in batched] == expected


def test_generate_batch_stops_a_row_at_eos(target):
    plain = one_at_a_time(target, PROMPTS, config(target.eos_token_ids), target.eos_token_ids)
    eos = plain[1][4]
    batched = generate_batch(target, PROMPTS, 2, config([eos]), GREEDY)
    assert batched[1] == plain[1][:5]
    assert [cut_at_eos(tokens, [eos]) for tokens in batched] == [
        tokens[: tokens.index(eos) + 1] if eos in tokens else tokens for tokens in plain]


def test_generate_batch_runs_an_int8_target_on_sdpa_and_gives_its_attention_back(int8_target):
    """specdec's int8 target computes attention row by row, which continuous batching refuses."""
    eos_ids = int8_target.eos_token_ids
    attention = int8_target.model.config._attn_implementation
    assert attention == "specdec_rowwise"
    expected = one_at_a_time(int8_target, PROMPTS, config(eos_ids), eos_ids)
    batched = generate_batch(int8_target, PROMPTS, 3, config(eos_ids), GREEDY)
    assert [cut_at_eos(tokens, eos_ids) for tokens in batched] == expected
    assert int8_target.model.config._attn_implementation == attention


def test_a_failed_generate_batch_is_one_reason_not_a_crash(target, monkeypatch, capsys):
    def broken_forward(*args, **kwargs):
        raise RuntimeError("kernel refused\nsecond line")

    monkeypatch.setattr(target.model, "forward", broken_forward)
    with pytest.raises(PeerUnavailable) as raised:
        generate_batch(target, PROMPTS, 2, config(target.eos_token_ids), GREEDY)
    assert str(raised.value) == "kernel refused"
    assert capsys.readouterr().err == ""  # transformers' logged traceback is kept, not printed


def test_the_paged_cache_holds_b_of_the_longest_requests():
    settings = continuous_batching_settings(4, [[1] * 100, [1] * 300], max_new_tokens=128)
    assert settings["max_requests_per_batch"] == 4
    assert settings["num_blocks"] * settings["page_size"] >= 4 * (300 + 128)
