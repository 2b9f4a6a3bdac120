"""`emapg eval --protocol paper-search`: question answering with a retriever, as the paper evaluates it.

Search-R1's evaluation data (parquet: question, golden_answers, data_source, optionally prompt;
one file may hold several benchmarks, e.g. nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa,
musique, bamboogle) is split by data_source, and every question is answered greedily in an
episode of up to 4 rounds with the top 3 passages per search (the search task's environment),
through a retrieval server (--retriever-url, Search-R1's /retrieve protocol) or a BM25 index of
a corpus (--corpus). Reported per dataset: exact match (the task's reward) and F1 of the final
`<answer>` against the gold answers (SQuAD normalisation), searches per episode, and the means
over datasets. Resumable and data-parallel as every evaluation on files (eval_files).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pydantic import model_validator

from emapg.eval import files as eval_files
from emapg.eval.files import Dataset, FileEvalSettings
from emapg.settings import check, setting
from emapg.tasks.search.answers import INFORMATION, f1
from emapg.tasks.search.task import INSTRUCTION, SearchTask, final_answer, load_parquet

# The paper's search protocol (Search-R1's): greedy, top-3 passages, up to 4 rounds of search,
# 500 new tokens a turn, passages cut to 500 tokens.
PROTOCOLS = {"paper-search": {"greedy": True, "n": 1, "max_new_tokens": 500, "topk": 3, "max_turns": 4}}


class SearchEvalSettings(FileEvalSettings):
    """`emapg eval` of search data (each field is the command's option of the same name)."""

    retriever_url: str = setting("", "a retrieval server, http://host:port/retrieve")
    corpus: str = setting("", "a jsonl corpus (id, contents = title line + text) indexed with BM25")
    topk: int = setting(3, "passages per search", ge=1)
    max_turns: int = setting(4, "rounds with the environment, then one final turn", ge=1)
    max_observation_tokens: int = setting(500, "inserted passages cut to this many tokens", ge=1)
    max_context: int = setting(4096, "prompt + episode tokens cap", ge=1)

    @model_validator(mode="after")
    def _one_retriever(self):
        check(bool(self.retriever_url) != bool(self.corpus), "give one of --retriever-url and --corpus")
        return self


def load_datasets(files: list[str], s: SearchEvalSettings) -> dict[str, Dataset]:
    """Every file read and checked (emapg.tasks.search.task.load_parquet) and split by data_source,
    before any model loads; one retriever serves them all."""
    from emapg.tasks.search.retriever import make_retriever

    rows_by_source: dict[str, tuple[str, list[dict]]] = {}
    for f in files:
        for row in load_parquet(f):
            source = str(row.get("data_source") or Path(f).stem)
            rows_by_source.setdefault(source, (f, []))[1].append(row)
    retriever = make_retriever(s.corpus, s.retriever_url)
    datasets = {}
    for source, (f, rows) in rows_by_source.items():
        task = SearchTask(
            retriever, [], rows, topk=s.topk, max_turns=s.max_turns, instruction=INSTRUCTION,
            max_observation_tokens=s.max_observation_tokens, max_context=s.max_context,
        )  # fmt: skip
        datasets[source] = Dataset(f, task, task.eval_examples())
    return datasets


def summarize(records: list[dict], datasets: dict[str, Dataset]) -> dict:
    """Per dataset: questions, exact match (the score), F1, searches per episode, mean length;
    and their means over the datasets, each weighing alike."""
    out = {}
    for name, data in datasets.items():
        mine = [r for r in records if r["dataset"] == name]
        golds = [data.examples[r["example"]].meta["golden_answers"] for r in mine]
        out[name] = {
            "questions": len(mine),
            "exact_match": statistics.fmean(r["score"] for r in mine),
            "f1": statistics.fmean(
                f1(final_answer(r["response"]), g) for r, g in zip(mine, golds, strict=True)
            ),
            "searches_mean": statistics.fmean(r["response"].count(INFORMATION[0]) for r in mine),
            "response_length_mean": statistics.fmean(r["length"] for r in mine),
        }
    return out


def evaluate(
    model_path: str, files: list[str], out_dir: str, settings: SearchEvalSettings, *, progress: bool = True
) -> dict:
    """Evaluate a local model on search data (eval_files.run); rank 0 returns (and writes to
    results.json) the figures, the other ranks {}."""
    datasets = load_datasets(files, settings)
    records = eval_files.run(model_path, datasets, out_dir, settings, progress=progress)
    if records is None:
        return {}
    figures = summarize(records, datasets)
    results = {"model": model_path, "settings": settings.model_dump(), "datasets": figures}
    if len(figures) > 1:
        keys = ("exact_match", "f1", "searches_mean", "response_length_mean")
        results["mean"] = {
            "questions": sum(d["questions"] for d in figures.values()),
            **{k: statistics.fmean(d[k] for d in figures.values()) for k in keys},
        }
    (Path(out_dir) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def table(results: dict) -> str:
    """The results as a plain-text table, one row per dataset and the mean."""
    header = ["dataset", "questions", "EM", "F1", "searches", "mean length (tokens)"]
    rows = [*results["datasets"].items(), *([("mean", results["mean"])] if "mean" in results else [])]
    body = [[name, str(r["questions"]), f"{r['exact_match']:.1%}", f"{r['f1']:.1%}", f"{r['searches_mean']:.2f}",
             f"{r['response_length_mean']:.1f}"] for name, r in rows]  # fmt: skip
    return eval_files.text_table(header, body)
