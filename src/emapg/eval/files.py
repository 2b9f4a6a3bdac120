"""`emapg eval` on data files: resumable, data-parallel sampling and grading of held-out sets.

The protocols build on this (math_eval.py: math files, avg@n and pass@k; search_eval.py:
question answering with a retriever, exact match and F1). Each dataset's examples are cut into
chunks of EXAMPLES_PER_CALL examples, each sampled `n` times in one engine call, through the
task's environment when it has one, and graded by the task's guarded scorer. A response's
sampling noise is seeded by its global row over the whole evaluation, so a chunk draws the same
responses whichever process samples it, and whenever.

In `out`: eval.json (the model, files and settings, and the size and modification time of each
file of the model and data: a restart must match them all), the responses of
each finished chunk appended to responses.part-<rank>.jsonl in one write flushed to disk, merged
into responses.jsonl at the end (and at a restart, which then samples only the chunks not yet
written: the results equal an uninterrupted run's). Under torchrun each process samples every
world-th chunk with its own engine (one GPU each) and rank 0 merges.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from tqdm.auto import tqdm

from emapg import distributed
from emapg.errors import EmapgError
from emapg.eval.evaluate import sample_and_score
from emapg.model.models import GenerationInfo, load_model_and_tokenizer, load_tokenizer
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams, eos_ids
from emapg.rollout.hf import HFEngine
from emapg.settings import Float, Section, setting
from emapg.tasks.base import Example, Task
from emapg.tasks.rewards import RewardScorer

EXAMPLES_PER_CALL = 8  # examples sampled per engine call: the unit a resumed evaluation redoes


class FileEvalSettings(Section):
    """Sampling and engine of an evaluation on files (each field is `emapg eval`'s option of the
    same name); a protocol (math_eval.PROTOCOLS, search_eval.PROTOCOLS) sets the defaults."""

    key: ClassVar[str] = "eval"
    n: int = setting(1, "responses per example", ge=1)
    greedy: bool = setting(False, "greedy decoding (then n must be 1)")
    temperature: Float = setting(1.0, "sampling temperature", gt=0)
    top_p: Float = setting(1.0, "nucleus sampling", gt=0, le=1)
    max_new_tokens: int = setting(
        1024, "response (multi-turn: turn) length limit, capped to the context", ge=1
    )
    batch_size: int = setting(64, "sequences per generate call (hf engine)", ge=1)
    seed: int = setting(0, "seed of the sampling")
    chat_template: bool = setting(True, "wrap prompts in the tokenizer's chat template")
    reward_timeout_s: Float = setting(10.0, "time limit of one grading call", gt=0)
    engine: Literal["hf", "vllm"] = setting("hf", "hf (transformers generate) or vllm")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "weights' dtype; auto: bfloat16 on a GPU, else float32"
    )
    gpu_memory_utilization: Float = setting(
        0.9, "vllm: share of GPU memory (on CPU: of RAM for the KV cache)", gt=0, lt=1
    )
    enforce_eager: bool = setting(False, "vllm: no CUDA graphs or compilation (faster start)")


@dataclass
class Dataset:
    """One held-out set: where it was read from, the task that prompts and grades it, its examples."""

    file: str
    task: Task
    examples: list[Example]


@dataclass(frozen=True)
class Chunk:
    dataset: str
    index: int
    first: int  # the dataset's first example in it
    examples: list[Example]
    first_row: int  # global row of its first example's first sample


def chunks_of(datasets: dict[str, Dataset], n: int) -> list[Chunk]:
    out, row = [], 0
    for name, data in datasets.items():
        for i in range(0, len(data.examples), EXAMPLES_PER_CALL):
            part = data.examples[i : i + EXAMPLES_PER_CALL]
            out.append(Chunk(name, i // EXAMPLES_PER_CALL, i, part, row + i * n))
        row += len(data.examples) * n
    return out


def run(model_path: str, datasets: dict[str, Dataset], out_dir: str, settings: FileEvalSettings,
        *, progress: bool = True) -> list[dict] | None:  # fmt: skip
    """Sample and grade every chunk not yet in `out_dir`; rank 0 returns every response record (in
    row order), the other ranks None. A record: dataset, chunk, row, example (its index in the
    dataset), sample, reference, response, score, length (tokens)."""
    if settings.greedy and settings.n != 1:
        raise EmapgError(f"eval: greedy decoding draws one response per example, not n={settings.n}")
    load_tokenizer(model_path)  # a wrong model path stops here, before anything is written
    device = distributed.init(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        out = Path(out_dir)
        identity = {"model": resolved(model_path), "files": {k: resolved(d.file) for k, d in datasets.items()},
                    "settings": settings.model_dump(), "model_stamp": stamp(model_path),
                    "data_stamp": {k: stamp(d.file) for k, d in datasets.items()}}  # fmt: skip
        if distributed.is_main():
            claim(out, identity)
            consolidate(out)
        distributed.barrier()
        done = {(r["dataset"], r["chunk"]) for r in read(out / "responses.jsonl")}
        todo = [c for i, c in enumerate(chunks_of(datasets, settings.n))
                if i % distributed.world() == distributed.rank() and (c.dataset, c.index) not in done]  # fmt: skip
        if todo:
            sample_chunks(
                model_path, datasets, todo, out, settings, device, progress and distributed.is_main()
            )
        distributed.barrier()
        if not distributed.is_main():
            return None
        consolidate(out)
        return read(out / "responses.jsonl")
    finally:
        distributed.close()


def resolved(path: str) -> str:
    """A local path made absolute (a restart may run from another directory); a Hugging Face
    cache name as it is."""
    return str(Path(path).resolve()) if Path(path).exists() else str(path)


def stamp(path: str) -> dict[str, list[int]] | None:
    """Size and modification time of each file of a local model folder or data file: a model
    exported again to the same folder, or a data file edited in place, is another evaluation
    (None: a hub name, nothing local to check)."""
    where = Path(path)
    if not where.exists():
        return None
    files = sorted(f for f in where.iterdir() if f.is_file()) if where.is_dir() else [where]
    stats = {f.name: f.stat() for f in files}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


# How a restart's mismatch is named: the key of eval.json, in words.
IDENTITY_NAMES = {"model": "model", "files": "data files", "settings": "settings",
                  "model_stamp": "model (its files were written again since)",
                  "data_stamp": "data (a file was written again since)"}  # fmt: skip


def claim(out: Path, identity: dict) -> None:
    """Start an evaluation in `out`, or continue the one it holds if it is the same."""
    out.mkdir(parents=True, exist_ok=True)
    path, identity = out / "eval.json", json.loads(json.dumps(identity))
    if path.is_file():
        held = json.loads(path.read_text())
        if held != identity:
            changed = [IDENTITY_NAMES[k] for k in identity if held.get(k) != identity[k]]
            raise EmapgError(
                f"eval: {out} holds an evaluation with another {' and '.join(changed)}; "
                "use another --out to start a new one (or delete it)"
            )
        return
    path.write_text(json.dumps(identity, indent=2) + "\n")


def read(path: Path) -> list[dict]:
    """The records of a responses file; a torn last line (a kill mid-write) is not a record."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def consolidate(out: Path) -> None:
    """responses.jsonl := its complete chunks and the parts' complete chunks, in row order; the
    parts are then deleted. A chunk is complete when all its examples x samples are there."""
    parts = sorted(out.glob("responses.part-*.jsonl"))
    by_chunk: dict[tuple, dict] = {}
    for r in read(out / "responses.jsonl") + [r for p in parts for r in read(p)]:
        by_chunk.setdefault((r["dataset"], r["chunk"]), {})[r["row"]] = r
    complete = [c for c in by_chunk.values() if len(c) == next(iter(c.values()))["chunk_size"]]
    ordered = sorted((r for c in complete for r in c.values()), key=lambda r: r["row"])
    tmp = out / "responses.jsonl.tmp"
    with tmp.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ordered)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / "responses.jsonl")
    for p in parts:
        p.unlink()


def make_engine(model_path: str, settings: FileEvalSettings, device: torch.device):
    """(engine, tokenizer, EOS ids, context length) of the evaluation."""
    dtype = (
        settings.dtype if settings.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    )
    if settings.engine == "vllm":
        from emapg.rollout.vllm import VllmEngine

        tokenizer, info = load_tokenizer(model_path), GenerationInfo(model_path)
        eos = eos_ids(info, tokenizer)
        # No prefix cache: a chunk then computes the same numbers whatever ran before it.
        engine = VllmEngine(
            model_path, tokenizer, dtype=dtype, seed=settings.seed, max_logprobs=1,
            gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager,
            eos_ids=eos, enable_prefix_caching=False,
        )  # fmt: skip
        return engine, tokenizer, eos, info.max_position_embeddings
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=getattr(torch, dtype))
    model.to(device).eval()
    engine = HFEngine(model, tokenizer, batch_size=settings.batch_size)
    return engine, tokenizer, eos_ids(model, tokenizer), model.config.max_position_embeddings


def response_budget(tokenizer, datasets: dict[str, Dataset], s: FileEvalSettings, context: int | None) -> int:
    """max_new_tokens, capped so the longest single-turn prompt and its response fit the model's
    context (a multi-turn task's episodes are capped by its environment)."""
    single = [e.prompt for d in datasets.values() if d.task.environment() is None for e in d.examples]
    if not context or not single:
        return s.max_new_tokens
    longest = max(len(ids) for ids in encode_prompts(tokenizer, single, s.chat_template))
    if longest >= context:
        raise EmapgError(
            f"eval: the longest prompt ({longest} tokens) fills the model's context of {context}"
        )
    if s.max_new_tokens > context - longest:
        tqdm.write(
            f"eval: max new tokens {s.max_new_tokens} capped at {context - longest}: the context is {context}"
        )
    return min(s.max_new_tokens, context - longest)


def sample_chunks(
    model_path, datasets, todo: list[Chunk], out: Path, s: FileEvalSettings, device, progress: bool
):
    engine, tokenizer, eos, context = make_engine(model_path, s, device)
    params = SamplingParams(max_new_tokens=response_budget(tokenizer, datasets, s, context), greedy=s.greedy,
                            temperature=s.temperature, top_p=s.top_p, seed=s.seed)  # fmt: skip
    part = out / f"responses.part-{distributed.rank()}.jsonl"
    tokens, start = 0, time.perf_counter()
    bar = tqdm(todo, desc="eval", disable=not progress, dynamic_ncols=True)
    with contextlib.ExitStack() as stack:
        stack.callback(engine.close)
        stack.callback(bar.close)
        scorers = {name: stack.enter_context(RewardScorer(d.task, timeout_s=s.reward_timeout_s))
                   for name, d in datasets.items()}  # fmt: skip
        for chunk in bar:
            task = datasets[chunk.dataset].task
            examples = [e for e in chunk.examples for _ in range(s.n)]
            batch, scored = sample_and_score(
                engine, tokenizer, task, examples, scorers[chunk.dataset], params, chat_template=s.chat_template,
                eos=eos, rows=range(chunk.first_row, chunk.first_row + len(examples)),
            )  # fmt: skip
            lengths = batch.response_mask.sum(1).tolist()
            records = [
                {"dataset": chunk.dataset, "chunk": chunk.index, "chunk_size": len(examples),
                 "row": chunk.first_row + i, "example": chunk.first + i // s.n, "sample": i % s.n,
                 "reference": e.answer, "response": text, "score": r, "length": n}
                for i, (e, text, r, n) in enumerate(zip(examples, batch.texts, scored.rewards, lengths, strict=True))
            ]  # fmt: skip
            with part.open("a") as f:  # the chunk in one write, on disk before the next starts
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
            tokens += sum(lengths)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}", dataset=chunk.dataset)


def text_table(header: list[str], body: list[list[str]]) -> str:
    """Rows as aligned plain text: the first column left-aligned, the figures right-aligned."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        + "\n"
        for row in [header, *body]
    )
