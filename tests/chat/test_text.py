import pytest

from specdec_cli.chat.text import ReplyText
from tests.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _push_one_by_one(tokenizer, ids):
    reply = ReplyText(tokenizer)
    pieces = []
    for position, token in enumerate(ids):
        pieces += reply.push([token], [f"p{position}"])
    return reply, pieces


def test_characters_split_across_tokens_come_out_whole(tokenizer):
    ids = tokenizer.encode("naïve 日本", add_special_tokens=False)
    assert len(ids) > len("naïve 日本")  # the tokenizer really splits characters into byte tokens
    reply, pieces = _push_one_by_one(tokenizer, ids)
    assert "".join(piece.text for piece in pieces) == "naïve 日本" == reply.shown
    assert not any("\ufffd" in piece.text for piece in pieces)
    # each character is shown with the token that completes it
    assert [piece.text for piece in pieces if piece.text in "ï日本"] == ["ï", "日", "本"]
    completing = {piece.text: piece.provenance for piece in pieces}
    assert completing["本"] == f"p{len(ids) - 1}"


def test_an_unfinished_character_is_held_back(tokenizer):
    ids = tokenizer.encode("a日", add_special_tokens=False)
    reply, pieces = _push_one_by_one(tokenizer, ids[:-1])
    assert [piece.text for piece in pieces] == ["a"] and reply.shown == "a"


def test_special_tokens_are_not_shown(tokenizer):
    ids = tokenizer.encode("Hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    reply, pieces = _push_one_by_one(tokenizer, ids)
    assert reply.shown == "Hello" and "".join(piece.text for piece in pieces) == "Hello"


def test_provenance_enums_become_their_names(tokenizer):
    from specdec_cli.engine import Provenance

    pieces = ReplyText(tokenizer).push(tokenizer.encode("Hi", add_special_tokens=False), [Provenance.BONUS] * 2)
    assert {piece.provenance for piece in pieces} == {"bonus"}
