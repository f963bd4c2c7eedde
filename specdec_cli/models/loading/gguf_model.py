"""A `.gguf` read in place for q4: the model is built from the file's metadata with its weights on the meta device,
then filled one tensor at a time from the memory-mapped file. A Linear layer whose tensor is Q4_0, Q4_1 or Q4_K
becomes q4 straight from those blocks (formats/gguf_q4.py: the file's own 4-bit values), one whose tensor is Q8_0,
Q6_K, Q5_0 or Q5_K a levels layer straight from its blocks (formats/gguf_levels.py: the file's own weights); any
other Linear tensor is dequantised alone and quantised to q4 from its exact values; the input embedding stays the
file's mapped blocks (formats/gguf_rows.py); norms and biases are dequantised alone into float32. No whole-model
float copy is made, in memory or on disk. q/k/v and gate/up are made fused here, as the lean layers run them, so the
stored layers hold them fused and a later load maps them; the file's pages are let go as each tensor becomes a
layer, and a large layer is made a piece at a time: a load holds about the file's size (a Qwen2.5-7B-shaped Q4_K_M
file's first load peaked at 1.26 times it, a later one at 1.08).

Split sets (`name-00001-of-00003.gguf`, as publishers ship large files) are read part by part: the first part holds
the metadata, every part holds tensors. Names and row orders are transformers' own (its GGUF name map and tensor
processors), so the model is the one transformers would build from the same file."""

from __future__ import annotations

import functools
import mmap
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from specdec_cli.errors import ModelLoadError
from specdec_cli.models.formats import gguf_levels, gguf_rows, q4, stored_layers
from specdec_cli.models.formats.gguf_q4 import BLOCKS, Q4_K, block_parts
from specdec_cli.models.formats.levels import LevelsLinear
from specdec_cli.models.formats.q4 import Q4KLinear, Q4Linear, quantize_packed
from specdec_cli.models.loading import gguf_file
from specdec_cli.models.runtime import decoder_stack, lean_layers

FROM_BLOCKS = {**BLOCKS, **gguf_levels.BLOCKS}  # the types whose blocks a layer keeps: channels, bytes a block

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path]:
    """Every part of the split set `path` belongs to, in order (`path` alone where it is no part of one); a
    ModelLoadError naming the first missing part where the set is not whole."""
    found = SPLIT.match(path.name)
    if found is None:
        return [path]
    count = int(found["count"])
    parts = [path.with_name(f"{found['stem']}-{index:05d}-of-{count:05d}.gguf") for index in range(1, count + 1)]
    missing = [part for part in parts if not part.is_file()]
    if missing:
        raise ModelLoadError(f"{path.name} is part {int(found['part'])} of {count}, and {missing[0].name} is not "
                             f"beside it", f"download every part of the set into {path.parent}")
    return parts


class _Tensors:
    """The tensors of a file or split set, by name, memory-mapped (gguf_file.py: its header read, not its metadata
    values)."""

    def __init__(self, parts: list[Path]) -> None:
        self.by_name = {}
        for part in parts:
            try:
                readable = gguf_file.tensors(part)
            except (ValueError, OSError, struct.error, EOFError) as error:  # a part cut short or damaged
                why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise ModelLoadError(f"cannot read the weights of {part.name}: {why}",
                                     "download the .gguf again (a cut or damaged file reads this way)") from None
            for tensor in readable:
                self.by_name[tensor.name] = tensor

    @staticmethod
    def release(tensor) -> None:
        """Drop the file's pages of `tensor` from this process's resident memory once its bytes were made into a layer:
        the system's page cache keeps them, but a load that touched every page of a 4 GiB file would otherwise count
        all of them at its peak."""
        mapped = getattr(getattr(tensor.data, "base", None), "_mmap", None)  # the file's mmap under its view
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(mapped), tensor.data_offset + tensor.n_bytes)
        try:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # the advice is only advice: memory then counts as before
            pass

    @staticmethod
    def values(tensor) -> np.ndarray:
        """The tensor's values in float32, rows first as numpy and torch hold them (one tensor: the only float copy)."""
        from gguf import dequantize

        return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)

    @staticmethod
    def blocks(tensor) -> np.ndarray | None:
        """The bytes (rows, row bytes) straight from the map of a tensor whose type a layer keeps, else None."""
        kind = int(tensor.tensor_type)
        if kind not in FROM_BLOCKS or tensor.data.ndim != 2:
            return None
        return np.asarray(tensor.data)


FUSING_SPARE = 1.1  # a fused layer of mixed types holds a little more than its parts (a Q4_K q/k + Q6_K v: 7.125 bits)


def bytes_in_place(path: Path) -> int:
    """What the model of the `.gguf` at `path` (or its split set) holds read in place, from its tensor table alone: a
    matrix of a type the layers keep (or the embedding, in any type) its own bytes with FUSING_SPARE over them, any
    other matrix q4's 5 bits a weight, everything else float32. The memory pre-flight's figure for it: the file's own
    sizes, where a float32 embedding and q4's 5 bits a weight counted 2 GiB too many for a 7B file with a large
    vocabulary, and too few for a Q8_0 one."""
    total = 0.0
    for tensor in _Tensors(split_parts(path)).by_name.values():
        kind, elements = int(tensor.tensor_type), int(np.prod([int(size) for size in tensor.shape]))
        if len(tensor.shape) != 2:
            total += 4 * elements
        elif kind in FROM_BLOCKS or tensor.name == "token_embd.weight":
            total += FUSING_SPARE * tensor.n_bytes
        else:
            total += elements * 5 / 8
    return int(total)


def _processor(config):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    # the file's architecture name, which transformers' processors are keyed by (llama.cpp writes Mistral as llama)
    architecture = {"mistral": "llama", "gemma3_text": "gemma3"}.get(config.model_type, config.model_type)
    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """Which row of the file each of transformers' rows is (its processing applied to a column of row numbers);
    None where that processing does more than reorder rows."""
    numbers = np.arange(rows, dtype=np.float64)[:, None]
    moved = processor.process(weights=numbers, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
    order = getattr(moved, "weights", None)
    if not isinstance(order, np.ndarray) or order.shape != numbers.shape:
        return None
    order = order[:, 0]
    return order.astype(np.int64) if np.array_equal(np.sort(order), numbers[:, 0]) else None


def _skeleton(config):
    """The model of `config` with its parameters on the meta device (its buffers, rotary tables among them, real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _linear_names(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _q4_layer(tensor, processor, linear: torch.nn.Linear,
              bias: torch.Tensor | None) -> tuple[Q4Linear | LevelsLinear, bool]:
    """(the layer of `linear` from the file's `tensor`, whether it keeps the file's blocks): q4 for a 4-bit type, a
    levels layer for Q8_0, Q6_K, Q5_0 and Q5_K, else q4 quantised from the tensor's values."""
    raw = _Tensors.blocks(tensor)
    kind = int(tensor.tensor_type)
    order = None if raw is None else _row_order(processor, tensor.name, raw.shape[0])
    shape_fits = (raw is not None and linear.in_features % FROM_BLOCKS[kind][0] == 0
                  and raw.shape[0] == linear.out_features)
    if order is not None and shape_fits:
        rows = raw if np.array_equal(order, np.arange(len(order))) else raw[order]
        if len(rows) <= CHUNK_ROWS:
            return _from_blocks(rows, kind, bias, linear.in_features), True
        return _in_pieces(rows, kind, bias, linear.in_features), True
    weight = _processed(tensor, processor)
    return Q4Linear(quantize_packed(weight), bias, linear.in_features, linear.out_features), False


# A layer of more rows is made this many at a time (_in_pieces): the unpacking's temporaries of a 152,064-row output
# layer took 3.1 GiB at once, a 7B file's load peak.
CHUNK_ROWS = 4096


def _in_pieces(rows: np.ndarray, kind: int, bias: torch.Tensor | None, width: int) -> Q4Linear | LevelsLinear:
    """The layer of `rows`, made CHUNK_ROWS at a time: each piece's bytes are copied into the whole's as it is made
    (blocks of q4.ROWS rows side by side, as fusing joins them), so the peak holds the whole and one piece; rows that
    end in a part-block are joined by fusing the pieces."""
    starts = range(0, len(rows), CHUNK_ROWS)
    if len(rows) % q4.ROWS:
        return lean_layers.fused([_from_blocks(rows[start:start + CHUNK_ROWS], kind,
                                               None if bias is None else bias[start:start + CHUNK_ROWS], width)
                                  for start in starts])
    packed = first = None
    for start in starts:
        piece = _from_blocks(rows[start:start + CHUNK_ROWS], kind, None, width)
        if packed is None:
            first = piece
            packed = torch.empty((len(rows) // q4.ROWS, *piece.packed_weight.shape[1:]),
                                 dtype=piece.packed_weight.dtype)
        packed[start // q4.ROWS:start // q4.ROWS + len(piece.packed_weight)] = piece.packed_weight
    if isinstance(first, LevelsLinear):
        return LevelsLinear(packed, first.form, bias, width, len(rows))
    return type(first)(packed, bias, width, len(rows))


def _from_blocks(rows: np.ndarray, kind: int, bias: torch.Tensor | None, width: int) -> Q4Linear | LevelsLinear:
    """The layer of `rows` (rows, row bytes) of a `kind` the layers keep."""
    if kind in gguf_levels.BLOCKS:
        return LevelsLinear.from_tables(*gguf_levels.level_parts(rows, kind), bias, width)
    parts = block_parts(rows, kind)
    if kind == Q4_K:
        return Q4KLinear.from_k_parts(*parts, bias, width)
    return Q4Linear.from_parts(*parts, bias, width)


def _processed(tensor, processor) -> torch.Tensor:
    """The tensor's float32 values as transformers would load them (rows reordered where it reorders them)."""
    result = processor.process(weights=_Tensors.values(tensor), name=tensor.name, tensor_key_mapping={},
                               parsed_parameters={"tensors": {}})
    values = np.ascontiguousarray(result.weights)
    return torch.from_numpy(values if values.flags.writeable else values.copy())  # an F32 tensor is the map itself


def _set(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    expected = getattr(owner, leaf)
    if tuple(expected.shape) != tuple(value.shape):
        raise ModelLoadError(f"the .gguf's tensor for {name} has the shape {tuple(value.shape)}, where the model its "
                             f"metadata describes has {tuple(expected.shape)}", "the file is damaged or mislabelled")
    owner._parameters[leaf] = torch.nn.Parameter(value.to(torch.float32), requires_grad=False)


def load_q4(path: Path, config, store: tuple[str, str] | None = None) -> torch.nn.Module:
    """The q4 model of the `.gguf` at `path` (or the split set it starts), its Linear layers Q4Linear, Q4KLinear or
    LevelsLinear, its input embedding the file's blocks where they are not F32 (formats/gguf_rows.py) and everything
    else float32; `model._specdec_q4_from_gguf` = (layers kept as the file's blocks, all linears),
    `model._specdec_requantised` = {a type with no kernel: how many layers of it were made q4 from their values},
    `model._specdec_kept_types` = {a type: how many layers kept it}. store: (key, label) of its stored layers
    (formats/stored_layers.py), read or made and stored."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    tensors = _Tensors(split_parts(path))
    model = _skeleton(config)
    processor = _processor(config)
    with _one_name_map():
        names = get_gguf_hf_weights_map(model, processor)  # gguf tensor name -> the model's parameter name
    linears = _linear_names(model)
    in_linears = {f"{name}.{leaf}" for name in linears for leaf in ("weight", "bias")}
    embedding = _embedding_tensor(model, names, tensors)
    rows = embedding if embedding is not None and _rows_kept(embedding, processor) else None
    for gguf_name, hf_name in names.items():
        if hf_name not in in_linears and gguf_name in tensors.by_name and (rows is None or gguf_name != rows.name):
            _set(model, hf_name, _processed(tensors.by_name[gguf_name], processor))
    if rows is not None:
        gguf_rows.keep_as_blocks(model.get_input_embeddings(), np.asarray(rows.data).view(np.uint8),
                                 int(rows.tensor_type))
    by_module = {hf_name.rpartition(".")[0]: gguf_name for gguf_name, hf_name in names.items()
                 if hf_name in in_linears and hf_name.endswith(".weight")}
    output = next((name for name, linear in linears.items() if linear is model.get_output_embeddings()), None)
    tied = output is not None and by_module.get(output) not in tensors.by_name and embedding is not None
    if tied:  # a tied output layer (no tensor of its own): made from the embedding's tensor, as llama.cpp does
        by_module[output] = embedding.name
    fused = decoder_stack.fuse_skeleton(model)  # q/k/v and gate/up made and stored as the lean layers run them
    model = stored_layers.replace_linears_stored(
        model, store, lambda whole: _linears_from_file(whole, fused, by_module, tensors, processor,
                                                       output if tied else None))
    kept, total, *by_type = getattr(model, stored_layers.NOTE)
    model._specdec_q4_from_gguf = (kept, total)
    model._specdec_requantised, model._specdec_kept_types = (*by_type, {}, {})[:2]
    missing = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if missing:
        raise ModelLoadError(f"{path.name} holds no tensor for {missing[0]} (and {len(missing) - 1} more) of the model "
                             "its metadata describes", "the file is damaged, or a part of a split set is missing")
    return model.eval()


@contextmanager
def _one_name_map() -> Iterator[None]:
    """While it lasts, gguf's tensor name map of an architecture and layer count is built once: transformers'
    get_gguf_hf_weights_map builds it again for every module it walks (371 times for a 28-layer model, 3-5 s of every
    load of a 7B file here), importing gguf's function as it runs."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _embedding_tensor(model: torch.nn.Module, names: dict[str, str], tensors: _Tensors):
    """The file's tensor of the model's input embedding (None where it has none)."""
    embedding = model.get_input_embeddings()
    module_name = next(name for name, module in model.named_modules() if module is embedding)
    gguf_name = next((gguf_name for gguf_name, hf_name in names.items() if hf_name == f"{module_name}.weight"), None)
    return tensors.by_name.get(gguf_name) if gguf_name else None


def _rows_kept(tensor, processor) -> bool:
    """Whether the embedding `tensor` is kept as its blocks: a type that saves memory so, held as rows, and
    transformers' processing of it a no-op (tried on a few rows of random values)."""
    if not gguf_rows.keeps(int(tensor.tensor_type)) or np.asarray(tensor.data).ndim != 2:
        return False
    probe = np.random.default_rng(0).standard_normal((4, int(tensor.shape[0]))).astype(np.float32)
    moved = processor.process(weights=probe.copy(), name=tensor.name, tensor_key_mapping={},
                              parsed_parameters={"tensors": {}})
    return isinstance(getattr(moved, "weights", None), np.ndarray) and np.array_equal(moved.weights, probe)


def _linears_from_file(model: torch.nn.Module, fused: dict, by_module: dict, tensors: _Tensors, processor,
                       tied: str | None) -> torch.nn.Module:
    """Every Linear of `model` to q4 from the file, in place, a `fused` one (decoder_stack.fuse_skeleton) made of its
    parts' layers (the note: the file's tensors kept, all, {type: requantised, a `tied` output layer made from a
    float embedding not counted: a float table is no type without a kernel})."""
    layers, kept, total, requantised, kept_types = {}, 0, 0, {}, {}
    for module_name, linear in _linear_names(model).items():
        made = []
        for part_name, part in fused.get(module_name, [(module_name, linear)]):
            tensor = tensors.by_name.get(by_module.get(part_name, ""))
            if tensor is None:
                break  # said as a missing tensor by the caller
            bias_tensor = tensors.by_name.get(tensor.name[: -len("weight")] + "bias")
            bias = None if part.bias is None or bias_tensor is None else _processed(bias_tensor, processor)
            layer, from_file = _q4_layer(tensor, processor, part, bias)
            tensors.release(tensor)
            made.append(layer)
            kept, total = kept + from_file, total + 1
            counted = kept_types if from_file else requantised if part_name != tied else {}
            counted[tensor.tensor_type.name] = counted.get(tensor.tensor_type.name, 0) + 1
        else:
            layers[module_name] = lean_layers.fused(made) if module_name in fused else made[0]
    for module_name, layer in layers.items():
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    setattr(model, stored_layers.NOTE, (kept, total, requantised, kept_types))
    return model
