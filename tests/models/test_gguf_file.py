"""A .gguf's tensors read from its header alone (loading/gguf_file.py) are gguf's own reader's tensors: the same
names, types, shapes, offsets and bytes, the same views of the file, whatever the metadata holds."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_cli.models.loading import gguf_file
from tests.tiny import build_4bit_gguf, random_blocks


def _same_as_ggufs_reader(path) -> None:
    from gguf import GGUFReader

    ours, theirs = gguf_file.tensors(path), GGUFReader(str(path), "r").tensors
    assert [tensor.name for tensor in ours] == [tensor.name for tensor in theirs] and ours
    for mine, reference in zip(ours, theirs):
        assert mine.tensor_type == reference.tensor_type and list(mine.shape) == [int(n) for n in reference.shape]
        assert (mine.data_offset, mine.n_bytes) == (reference.data_offset, reference.n_bytes)
        assert mine.data.shape == reference.data.shape and mine.data.dtype == reference.data.dtype
        assert np.array_equal(np.asarray(mine.data), np.asarray(reference.data))


@pytest.mark.parametrize("embedding", ["F32", "F16", "Q5_0"])
def test_a_models_tensors_are_ggufs_readers(tmp_path, embedding):
    """A tiny model's file: a vocabulary, merges and a chat template among its metadata values, Q4_K, Q6_K, Q8_0
    and Q5_K layers, F32 norms."""
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path, kinds={"ffn_down": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q5_K"}, embedding=embedding)
    _same_as_ggufs_reader(path)


def test_every_value_type_and_another_alignment(tmp_path):
    """Metadata of every value type (arrays of numbers, of strings and of arrays among them) and an alignment of
    64 instead of the default 32 before the tensors."""
    import gguf

    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    for index, (name, value, kind) in enumerate([
            ("u8", 7, gguf.GGUFValueType.UINT8), ("i16", -3, gguf.GGUFValueType.INT16),
            ("f64", 0.25, gguf.GGUFValueType.FLOAT64), ("flag", True, gguf.GGUFValueType.BOOL),
            ("u64", 2**40, gguf.GGUFValueType.UINT64), ("text", "héllo", gguf.GGUFValueType.STRING)]):
        writer.add_key_value(f"test.{index}.{name}", value, kind)
    writer.add_array("test.numbers", [1.5, 2.5, 3.5])
    writer.add_array("test.words", ["a", "bc", "", "déf"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("a.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b.weight", random_blocks("Q4_0", 3, 64, np.random.default_rng(0)),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("c.weight", np.ones((5, 7), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_ggufs_reader(path)
    assert gguf_file.tensors(path)[1].data_offset % 64 == 0


def test_a_file_cut_inside_its_header_or_its_tensors_is_an_eof_error(tmp_path):
    path = tmp_path / "m.gguf"
    build_4bit_gguf(path)
    data = path.read_bytes()
    for cut in (10, 3000, len(data) - 100):
        path.write_bytes(data[:cut])
        with pytest.raises(EOFError):
            gguf_file.tensors(path)
