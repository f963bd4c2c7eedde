"""A draft head trained here, on the target's own features (EAGLE / Hydra style): how much of the target's greedy
output it predicts, beside the 0.5B draft model's agreement on the same text. A probe of whether a learned head
could replace the draft model (a draft token costs a small MLP and a 32k-row output layer, 5-8% of a target forward
where the q4 draft's costs ~37%: `cost`), without an engine path or a kernel for it.

    python scripts/draft_head.py cost --json benchmarks/....json   # a head's draft token beside the two forwards
    python scripts/draft_head.py inputs DIR
    specdec run DIR/train.jsonl -o DIR/train-out.jsonl -b 16 --drafter ngram -q
    specdec run DIR/val.jsonl -o DIR/val-out.jsonl -b 16 --drafter ngram -q
    python scripts/draft_head.py probe --train DIR/train-out.jsonl --val DIR/val-out.jsonl [--fractions 0.25,0.5,1]
        [--features DIR/features.pt] --json benchmarks/....json

`inputs` writes Spec-Bench requests (chat messages, greedy, 128 tokens): val.jsonl holds the 2nd and 3rd question of
each category, train.jsonl the 4th on (--per-category caps them); the 1st of each category is the benchmark's
(`compare`, the issue's 13 prompts) and is in neither. `specdec run` makes the demo target's greedy answers, 16 at a
time. `probe` reads each output beside its input (X-out.jsonl beside X.jsonl; several --train files may be given):

- features: the q4 target reads the system prompt, the question (its last --prompt-window tokens) and the answer
  in one forward; each position's last hidden state (after the final norm) and the target's top token there;
- the head: s_j = RMSNorm(s_{j-1} + W2 silu(W1 [s_{j-1}; e(x_{t+j})])), s_0 = the target's feature at t, e the
  target's input embedding; s_j scores the next token through the target's own output layer, on its first --vocab
  ids (the FR-Spec subset the draft uses; ids outside it are never drafted). Trained on every position (prompt and
  answer: the answers alone are too few) for --unroll steps on its own states, with cross-entropy on the target's
  top token and a smooth-L1 pull of s_j toward the target's feature at t+j (EAGLE's regression);
- measured on the val answers: from every answer position t, the chain the head drafts after the target's own
  token at t+1, greedy, and the share accepted at each depth (given the depths before were); and the q4 draft's
  agreement (its top token equals the target's, teacher-forced, the drafter's window and subset head) over the
  same answers: the quantity the head's first depth compares with.

--fractions trains one head on each share of the training records (a learning curve: how far more data would
carry it); --features keeps the target's features in a file, read back by the next run.

benchmarks/2026-12-07-draft-head-probe-amd-avx512-q4.json was trained on two outputs of `inputs`' train.jsonl: its
first 166 requests (a run stopped there), then 22 more of each of the four categories it had not reached
(summarization, qa, math_reasoning, rag), as its train_records say."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from levers import QUESTIONS  # scripts/levers.py: the Spec-Bench questions
from policy_replay import drafted_over  # the draft as the model drafter runs it, teacher-forced
from specdec_cli.drafters.subset_head import SubsetHeadLM, frequent_token_ids
from specdec_cli.models import load_model
from specdec_cli.models.calibrate import forward_costs_together, machine
from specdec_cli.session import DRAFT_WINDOW, encode_chat

SYSTEM = "You are a helpful coding assistant."  # the demo profile's system prompt, which `specdec run` sends


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    inputs = commands.add_parser("inputs")
    inputs.add_argument("folder")
    inputs.add_argument("--per-category", type=int, default=80)
    inputs.add_argument("--max-new-tokens", type=int, default=128)
    cost = commands.add_parser("cost")
    cost.add_argument("--vocab", type=int, default=32768)
    cost.add_argument("--hidden", type=int, default=2048)
    cost.add_argument("--json", default="")
    probe = commands.add_parser("probe")
    probe.add_argument("--train", action="append", required=True)
    probe.add_argument("--val", required=True)
    probe.add_argument("--prompt-window", type=int, default=384)
    probe.add_argument("--vocab", type=int, default=32768)
    probe.add_argument("--hidden", type=int, default=2048)
    probe.add_argument("--epochs", type=int, default=4)
    probe.add_argument("--unroll", type=int, default=3)
    probe.add_argument("--depth", type=int, default=6)
    probe.add_argument("--fractions", default="1",
                       help="train a head on each share of the training records (comma-separated): a learning curve")
    probe.add_argument("--features", default="", help="a file to keep the features in (read back when it exists)")
    probe.add_argument("--json", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.command == "inputs":
        write_inputs(Path(args.folder), args.per_category, args.max_new_tokens)
    elif args.command == "cost":
        time_costs(args)
    else:
        run_probe(args)


def write_inputs(folder: Path, per_category: int, max_new_tokens: int) -> None:
    """train.jsonl and val.jsonl in `folder` (see the module's text)."""
    folder.mkdir(parents=True, exist_ok=True)
    seen: Counter = Counter()
    lines = defaultdict(list)
    for line in QUESTIONS.read_text().splitlines():
        question = json.loads(line)
        seen[question["category"]] += 1
        rank = seen[question["category"]]
        part = None if rank == 1 else "val" if rank <= 3 else "train" if rank - 3 <= per_category else None
        if part:
            lines[part].append(json.dumps({"id": str(question["question_id"]), "category": question["category"],
                                           "messages": [{"role": "user", "content": question["turns"][0]}],
                                           "max_tokens": max_new_tokens, "temperature": 0}))
    for part in ("train", "val"):
        (folder / f"{part}.jsonl").write_text("".join(line + "\n" for line in lines[part]))
        print(f"{folder / part}.jsonl: {len(lines[part])} requests")


def answered(output: Path) -> list[dict]:
    """Each answered request of a `specdec run` output, with its messages and category from the input beside it."""
    requests = {}
    for line in output.with_name(output.name.replace("-out", "")).read_text().splitlines():
        request = json.loads(line)
        requests[request["id"]] = request
    return [requests[record["id"]] | {"text": record["text"]}
            for record in map(json.loads, output.read_text().splitlines()) if not record.get("error")]


@torch.inference_mode()
def features(target, records: list[dict], prompt_window: int) -> list[dict]:
    """Per record: the ids the target read, its features and top tokens there, and where the answer starts."""
    read = []
    for record in records:
        prompt = encode_chat(target.tokenizer, [{"role": "system", "content": SYSTEM}, *record["messages"]])
        prompt = prompt[-prompt_window:]
        answer = target.tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + answer])
        hidden = target.model.model(input_ids=ids).last_hidden_state[0]
        read.append({"ids": ids[0], "h": hidden.to(torch.bfloat16), "top": target.model.lm_head(hidden).argmax(-1),
                     "answer_from": len(prompt), "prompt": prompt, "answer": answer,
                     "category": record["category"]})
    return read


class Head(torch.nn.Module):
    """s_j = RMSNorm(s_{j-1} + W2 silu(W1 [s_{j-1}; e(x)]))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(2 * width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.norm = torch.nn.RMSNorm(width)

    def forward(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.norm(state + self.down(F.silu(self.up(torch.cat([state, embedded], -1)))))


class Flat:
    """The records' positions in one row each: features, ids, the target's top tokens; `starts`: the positions a
    chain is drafted from (every one, or the answers' only), each with `reach` positions after it."""

    def __init__(self, read: list[dict], reach: int, answers_only: bool) -> None:
        self.h = torch.cat([r["h"] for r in read])
        self.ids = torch.cat([r["ids"] for r in read])
        self.top = torch.cat([r["top"] for r in read])
        starts, offset = [], 0
        for r in read:
            first = r["answer_from"] - 1 if answers_only else 0
            starts.append(torch.arange(first, len(r["ids"]) - reach) + offset)
            offset += len(r["ids"])
        self.starts = torch.cat(starts)


def train(head: Head, data: Flat, rows: torch.Tensor, to_row: torch.Tensor, embedding: torch.Tensor,
          epochs: int, unroll: int, check) -> list[dict]:
    """AdamW, one-cycle 1e-3, batches of 256 positions, bfloat16 autocast; `check()` after each epoch."""
    optimiser = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.01)
    steps = epochs * math.ceil(len(data.starts) / 256)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, 1e-3, total_steps=steps)
    log, started = [], time.perf_counter()
    for epoch in range(epochs):
        order = data.starts[torch.randperm(len(data.starts))]
        for first in range(0, len(order), 256):
            at = order[first:first + 256]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                state, loss = data.h[at].float(), 0.0
                for j in range(1, unroll + 1):
                    state = head(state, embedding[data.ids[at + j]].float())
                    loss = loss + F.cross_entropy((state @ rows.T).float(), to_row[data.top[at + j]], ignore_index=-100)
                    loss = loss + 0.1 * F.smooth_l1_loss(state.float(), data.h[at + j].float())
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
        log.append({"epoch": epoch + 1, "loss": round(float(loss.detach()), 4),
                    "seconds": round(time.perf_counter() - started, 1), **check()})
        print(log[-1], flush=True)
    return log


@torch.no_grad()
def chain_acceptance(head: Head, data: Flat, rows: torch.Tensor, row_ids: torch.Tensor, embedding: torch.Tensor,
                     depth: int) -> dict:
    """From every start t: the head drafts `depth` tokens after the target's own token at t+1, greedy; per depth the
    share accepted among the chains still alive, and the mean accepted length."""
    state, token = data.h[data.starts].float(), data.top[data.starts]
    alive, accepted, rates = torch.ones(len(data.starts), dtype=torch.bool), torch.zeros(len(data.starts)), []
    for j in range(1, depth + 1):
        state = head(state, embedding[token].float())
        token = row_ids[(state @ rows.T).argmax(-1)]
        agree = alive & (token == data.top[data.starts + j])
        rates.append(round(float(agree.sum() / alive.sum().clamp(min=1)), 4))
        accepted += agree
        alive = agree
    return {"accepted_at_depth": rates, "mean_accepted": round(float(accepted.mean()), 4)}


@torch.inference_mode()
def time_costs(args) -> None:
    """What a head's draft token costs beside a one-token forward of the q4 target and of the q4 draft (its whole
    output layer), in one process: the forwards on a 200-token cache (calibrate's measure), the head's parts as the
    median of 60 calls (its MLP in float32 and bfloat16, the target's q4 output layer cut to --vocab ids)."""
    target = load_model("demo:qwen2.5-coder-1.5b", quantization="q4", progress=False)
    draft = load_model("demo:qwen2.5-coder-0.5b", quantization="q4", role="draft", progress=False)
    forwards = forward_costs_together({"target": target, "draft": draft}, (1,), repeats=15)
    width = target.model.config.hidden_size
    _, layer = output_layer(target, args.vocab)
    head = Head(width, args.hidden)
    state, embedded = torch.randn(1, 1, width), torch.randn(1, 1, width)
    parts = {"mlp_float32": median_ms(lambda: head(state, embedded)),
             "mlp_bfloat16": median_ms(lambda: head.to(torch.bfloat16)(state.bfloat16(), embedded.bfloat16())),
             "output_layer_q4": median_ms(lambda: layer(state))}
    result = {"machine": machine(), "target_ms": round(forwards["target"]["1"] * 1e3, 2),
              "draft_ms": round(forwards["draft"]["1"] * 1e3, 2), "head_vocab": args.vocab,
              "head_ms": {name: round(value, 3) for name, value in parts.items()}}
    print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def output_layer(target, vocab: int) -> tuple[torch.Tensor, torch.nn.Module]:
    """The ids a head scores (the draft's FR-Spec subset of `vocab`) and the target's q4 output layer cut to them."""
    ids = frequent_token_ids(target.tokenizer, vocab, target.vocab_size)
    return ids, SubsetHeadLM(target.model, ids).head


def median_ms(call, repeats: int = 60) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e3


def run_probe(args) -> None:
    target = load_model("demo:qwen2.5-coder-1.5b", quantization="q4", progress=False)
    draft = load_model("demo:qwen2.5-coder-0.5b", quantization="q4", role="draft", progress=False)
    train_records = [record for path in args.train for record in answered(Path(path))]
    val_records = answered(Path(args.val))
    kept = Path(args.features) if args.features else None
    if kept and kept.exists():
        train_read, val_read, feature_seconds = torch.load(kept)
    else:
        started = time.perf_counter()
        train_read = features(target, train_records, args.prompt_window)
        val_read = features(target, val_records, args.prompt_window)
        feature_seconds = time.perf_counter() - started
        if kept:
            torch.save((train_read, val_read, feature_seconds), kept)
    ids, layer = output_layer(target, args.vocab)
    with torch.inference_mode():
        rows = layer(torch.eye(target.model.config.hidden_size)).t().contiguous()  # the q4 rows, as floats
        embedding = target.model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    to_row = torch.full((target.vocab_size,), -100, dtype=torch.long)
    to_row[ids] = torch.arange(len(ids))
    val_data = Flat(val_read, args.depth, answers_only=True)
    curve = []
    order = torch.randperm(len(train_read)).tolist()
    for fraction in [float(share) for share in args.fractions.split(",")]:
        taken = [train_read[i] for i in sorted(order[: max(1, round(fraction * len(train_read)))])]
        train_data = Flat(taken, args.unroll, answers_only=False)
        covered = float((to_row[train_data.top[train_data.starts + 1]] >= 0).float().mean())
        print(f"{len(taken)} train records, {len(train_data.starts)} positions, val answer positions "
              f"{len(val_data.starts)}, features {feature_seconds:.0f} s, target tokens in the {len(ids)}-id subset "
              f"{covered:.3f}", flush=True)
        head = Head(target.model.config.hidden_size, args.hidden)
        log = train(head, train_data, rows, to_row, embedding, args.epochs, args.unroll,
                    lambda: chain_acceptance(head, val_data, rows, ids, embedding, args.depth))
        curve.append({"fraction": fraction, "train_records": len(taken), "train_positions": len(train_data.starts),
                      "subset_coverage": round(covered, 4), "epochs": log, "head_val": log[-1]})
    drafted = drafted_over([{"prompt": r["prompt"], "output": r["answer"]} for r in val_read], draft, DRAFT_WINDOW)
    draft_agreement = (sum(sum(top == token for top, token in zip(d["draft_top"], d["output"])) for d in drafted)
                       / sum(len(d["output"]) for d in drafted))
    result = {"machine": machine(), "target": target.describe("target"), "draft": draft.describe("draft"),
              "train_records": dict(Counter(r["category"] for r in train_records)),
              "val_records": dict(Counter(r["category"] for r in val_records)),
              "val_answer_positions": len(val_data.starts), "prompt_window": args.prompt_window, "vocab": len(ids),
              "head_parameters": sum(p.numel() for p in head.parameters()), "hidden": args.hidden,
              "unroll": args.unroll, "feature_seconds": round(feature_seconds, 1), "heads": curve,
              "draft_val_agreement": round(draft_agreement, 4)}
    print(f"draft agreement on the val answers: {draft_agreement:.4f}; heads: {[c['head_val'] for c in curve]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
