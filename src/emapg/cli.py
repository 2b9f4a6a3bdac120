"""Command line: emapg train | eval | export | sft | report | build-index | serve-retriever."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from emapg.errors import EmapgError

TRAIN_EPILOG = """\
overrides are dotted config fields, e.g. `kl.k=16 anchor.eta=0.95 train.steps=100`.
Shipped configs: quickstart (the default), grpo, ema_pg, math_tiny, math_qwen, smollm2_math, search_tiny,
search_qwen. Every field:

"""


def import_user_modules(specs: list[str]) -> None:
    """`--import`: modules (names importable from here, or paths to .py files) whose import
    registers tasks or engines. A file's directory joins sys.path, so that the reward worker
    process, which gets this sys.path, can import it too."""
    for spec in specs:
        path = Path(spec).expanduser()
        if spec.endswith(".py"):
            if not path.is_file():
                raise EmapgError(f"--import {spec}: no such file")
            folder, name = str(path.resolve().parent), path.stem
        else:
            folder, name = os.getcwd(), spec  # as `python -m` does
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            importlib.import_module(name)
        except Exception as e:
            raise EmapgError(f"--import {spec}: importing it raised {type(e).__name__}: {e}") from None


def _train(args) -> None:
    import yaml

    from emapg.training.config import run_config
    from emapg.training.loop import train

    import_user_modules(args.imports)
    cfg = run_config(args.config, args.overrides, resume=args.resume)
    if args.print_config:
        print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
        return
    result = train(cfg, resume=args.resume)
    # Under torchrun rank 0 reports for all; the process group is closed by now, so ask the env.
    if os.environ.get("RANK", "0") != "0":
        return
    before, after = result["accuracy_before"], result["accuracy_after"]
    low, high = result["reward_range"]
    if low >= 0 and high <= 1:  # a rate: the share of right answers
        change = f"{before:.1%} before training -> {after:.1%} after ({100 * (after - before):+.1f} points)"
    else:  # a mean reward on another scale (e.g. weighted reward functions): not a percentage
        change = f"{before:.3f} before training -> {after:.3f} after ({after - before:+.3f})"
    print(f"eval/accuracy {change}; run: {result['run_dir']}")


def _rollout_worker(args) -> None:
    from emapg.rollout.remote.worker import serve

    if args.rank < 1:
        raise EmapgError(f"--rank {args.rank}: workers have ranks 1 and up (0 is the trainer)")
    import_user_modules(args.imports)
    serve(args.address, args.rank, args.threads)


def _sft(args) -> None:
    from emapg.model.models import pin_cpu_kernels
    from emapg.tasks import make_task
    from emapg.training.config import load_config
    from emapg.training.setup import load_policy, warm_started

    import_user_modules(args.imports)
    cfg = load_config(args.config, args.overrides)
    if not warm_started(cfg):
        # load_policy would load the model as it is, and "ready" would name a warm start never built
        raise EmapgError(
            f"emapg sft: model.path={cfg.model.path} is not warm-started under this config "
            "(set warmstart.pretrained=true to warm-start a pretrained model)"
        )
    if cfg.model.path == "builtin:tiny":
        pin_cpu_kernels()  # as `emapg train` does, before any CPU kernel runs
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    *_, folder = load_policy(cfg, task, progress=cfg.train.progress)
    print(f"warm start ready: {folder}")


def _eval(args) -> None:
    if args.run is not None:
        return _eval_run(args)
    if args.model is None or not args.data:
        raise EmapgError(
            "emapg eval: give --run RUN_DIR (a run's checkpoint), or --model DIR with --data FILE"
        )
    from emapg.settings import validated

    if args.protocol == "paper-search":
        from emapg.eval import search as protocol

        settings_class = protocol.SearchEvalSettings
    else:
        from emapg.eval import math as protocol

        settings_class = protocol.MathEvalSettings
    names = ["n", "temperature", "top_p", "max_new_tokens", "batch_size", "seed", "engine", "dtype",
             "gpu_memory_utilization", "enforce_eager", "prompt", "retriever_url", "corpus", "topk", "max_turns"]  # fmt: skip
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    values = {**protocol.PROTOCOLS[args.protocol], **given, "chat_template": not args.no_chat_template}
    options = {k: "--" + k.replace("_", "-") for k in names}  # a problem names the option
    settings = validated(settings_class, values, "eval", options)
    from emapg.model.models import model_folder

    model = model_folder(args.model, progress=not args.no_progress)  # a GGUF: its converted folder
    out = args.out or "runs/eval"  # a folder holding another model's or data's evaluation is refused
    results = protocol.evaluate(model, args.data, out, settings, progress=not args.no_progress)
    if not results:  # a process other than rank 0 under torchrun
        return
    print(protocol.table(results), end="")
    print(f"results: {Path(out) / 'results.json'}; responses: {Path(out) / 'responses.jsonl'}")


def _eval_run(args) -> None:
    if args.model is not None or args.data:
        raise EmapgError(
            "emapg eval --run evaluates the run's own checkpoint on its task: drop --model/--data"
        )
    from emapg.training.checkpoint_eval import evaluate_checkpoint, write_results

    import_user_modules(args.imports)
    results = evaluate_checkpoint(args.run, args.step, anchor=args.anchor)
    name = "eval/anchor/accuracy" if args.anchor else "eval/accuracy"
    # By default beside the run, one folder per checkpoint and weights: evaluations never overwrite each other.
    checkpoint = Path(results["checkpoint"])
    out = args.out or checkpoint.parents[1] / "eval" / (checkpoint.name + ("-anchor" if args.anchor else ""))
    print(
        f"{name} {results['accuracy']:.4f} ({results['checkpoint']}: {results['problems']} problems x "
        f"{results['samples_per_problem']} samples); results: {write_results(results, out)}"
    )


def _export(args) -> None:
    from emapg.training.export import export

    path, dtype = export(args.run, args.out, args.step, anchor=args.anchor, dtype=args.dtype)
    print(f"exported the {'anchor' if args.anchor else 'policy'} of {path} to {args.out} in {str(dtype)[6:]}")


def _report(args) -> None:
    from emapg.eval.report import report

    print(report(args.runs, args.out, args.threshold, args.smooth), end="")
    print(f"curves: {args.out}; table: {Path(args.out).with_suffix('.md')}")


def _encoder_settings(args, default_from_index: bool = False):
    """The encoder flags as settings; None where none was given and the index says them."""
    from emapg.tasks.search.dense import EncoderSettings

    given = {k: getattr(args, k) for k in ("query_prefix", "passage_prefix", "pooling", "max_length",
                                            "batch_size") if getattr(args, k) is not None}  # fmt: skip
    for flag in ("max_length", "batch_size"):
        if given.get(flag, 1) < 1:
            raise EmapgError(f"--{flag.replace('_', '-')} {given[flag]}: expected >= 1")
    if not given and default_from_index:
        return None
    return EncoderSettings(**given)


def _build_index(args) -> None:
    corpus = Path(args.corpus).expanduser()
    if not args.dense:
        from emapg.tasks.search.bm25 import build_index

        if args.out:
            raise EmapgError("--out is for --dense: the BM25 index is kept beside its corpus (<corpus>.bm25)")
        out = corpus.with_name(corpus.name + ".bm25")
        meta = build_index(corpus, out)
        print(f"BM25 index of {meta['num_docs']} documents in {out}")
        return
    from emapg.tasks.search.dense import build_dense_index

    if not args.encoder:
        raise EmapgError("build-index --dense needs --encoder PATH (a local Hugging Face encoder folder)")
    if args.shard_docs < 1:
        raise EmapgError(f"--shard-docs {args.shard_docs}: expected >= 1")
    out = Path(args.out or corpus.with_name(corpus.name + ".dense"))
    meta = build_dense_index(
        corpus, out, args.encoder, _encoder_settings(args), index_type=args.index_type,
        shard_docs=args.shard_docs, progress=not args.no_progress, nlist=args.nlist,
    )  # fmt: skip
    print(f"{meta['index_type']} index of {meta['num_docs']} {meta['dim']}-dimensional vectors in {out}")


def _serve_retriever(args) -> None:
    from emapg.tasks.search.server import make_server

    if not 0 <= args.port <= 65535:
        raise EmapgError(f"--port {args.port}: expected 0..65535")
    for flag in ("max_queries", "max_query_chars", "max_pending", "workers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise EmapgError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected >= 1")
    if args.dense is None:
        from emapg.tasks.search.bm25 import BM25Retriever

        retriever = BM25Retriever(args.corpus)
    else:
        from emapg.tasks.search.dense import DenseRetriever

        if not args.encoder:
            raise EmapgError("serve-retriever --dense needs --encoder PATH (the encoder of the index)")
        if (args.workers or 1) > 1:  # FAISS searches on every core from one process already
            raise EmapgError("serve-retriever --workers is for BM25; --dense searches in this process")
        corpus = Path(args.corpus).expanduser()
        index = args.dense or corpus.with_name(corpus.name + ".dense")
        retriever = DenseRetriever(
            index, corpus, args.encoder, _encoder_settings(args, default_from_index=True),
            nprobe=args.nprobe, ef_search=args.ef_search,
        )  # fmt: skip
    try:
        server = make_server(
            retriever, args.host, args.port, args.max_queries, args.max_query_chars, args.max_pending,
            workers=args.workers,
        )  # fmt: skip
    except OSError as e:
        raise EmapgError(
            f"serve-retriever: cannot listen on {args.host}:{args.port} ({e.strerror})"
        ) from None
    host, port = server.server_address[:2]
    print(f"serving {len(retriever.docs)} documents at http://{host}:{port}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _add_import_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """`--import MODULE`, repeatable: declared here once for every subcommand that takes it, each
    with its own help (what the imported module is for there)."""
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE", help=help)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config, --import and key=value overrides: how train and sft name a run's config."""
    parser.add_argument("--config", help="YAML config file or shipped config name (default: quickstart)")
    _add_import_argument(
        parser, "import a module (a name, or path/to/file.py) first: its register_task calls add tasks"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")


def _add_train_parser(sub, field_help: bool) -> None:
    """`emapg train`. With `field_help` every config field's help goes into its epilog; only then,
    as building that text imports every part's settings."""
    fields = ""
    if field_help:
        from emapg.training.config_reference import help_text

        fields = help_text()
    train = sub.add_parser(
        "train",
        help="train with EMA-PG (default: the CPU quickstart)",
        epilog=TRAIN_EPILOG + fields,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_arguments(train)
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run <train.output_dir>/<train.name> from its last complete checkpoint, under "
        "its saved config.yaml; key=value overrides apply on top (each change is printed)",
    )
    train.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    train.set_defaults(func=_train)


def _add_rollout_worker_parser(sub) -> None:
    """`emapg rollout-worker`: one async run's remote rollout worker."""
    worker = sub.add_parser(
        "rollout-worker",
        help="serve as an async run's rollout worker, on this host or another (docs/training.md)",
        description="Join the run whose trainer listens at --address (its rollout.address, a fixed port) "
        "as worker --rank: rollout.workers + 1 .. rollout.workers + rollout.remote_workers. The run's "
        "config and model directory come from the trainer; the model directory must be readable here.",
    )
    worker.add_argument("--address", required=True, help="the trainer's rollout.address, HOST:PORT")
    worker.add_argument("--rank", type=int, required=True, help="this worker's rank (1 or more)")
    worker.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    _add_import_argument(worker, "a module to import first (the run's task or engine, if a user's)")
    worker.set_defaults(func=_rollout_worker)


def _add_sft_parser(sub) -> None:
    """`emapg sft`: the cached supervised warm start, without training."""
    sft = sub.add_parser(
        "sft",
        help="build (or reuse) the cached supervised warm start of a config's model "
        "(builtin:tiny, or a pretrained one with warmstart.pretrained=true)",
    )
    _add_config_arguments(sft)
    sft.set_defaults(func=_sft)


def _add_eval_parser(sub) -> None:
    """`emapg eval`: its two modes' options (--run, or --model with --data and --protocol), then
    the options that override the protocol's values, then --out."""
    ev = sub.add_parser(
        "eval",
        help="math accuracy and pass@k of a model on problem files (--model, --data), or a run's "
        "checkpoint on its held-out set as the run evaluated it (--run)",
        description="Two modes. --model DIR --data FILE...: data files evaluated as the paper did "
        "(--protocol, then the options below; resumable: rerun the same command after a kill; under "
        "torchrun one process per GPU). --run RUN_DIR [--step N] [--anchor]: the run's checkpoint on the "
        "run's held-out set, sampled with the run's own eval section and seed: the run's eval/accuracy "
        "(with --anchor eval/anchor/accuracy) at that step.",
    )
    ev.add_argument(
        "--run", help="a run directory: evaluate its checkpoint with its config (eval section, seed)"
    )
    ev.add_argument("--step", type=int, help="with --run: the checkpoint's step (default: the last)")
    ev.add_argument(
        "--anchor", action="store_true", help="with --run: the anchor's weights, not the policy's"
    )
    _add_import_argument(ev, "with --run: a module to import first (the run's task, if a user's)")
    ev.add_argument(
        "--model", help="local model directory (safetensors, with tokenizer), a .gguf file, or smollm2"
    )
    ev.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="math problem files (.jsonl/.json/.parquet) or Search-R1 parquet",
    )
    ev.add_argument(
        "--protocol", choices=["paper-math", "paper-search"], default="paper-math",
        help="the paper's evaluation: paper-math (math files: n 32, temperature 0.8, top-p 0.9, 28000 "
        "tokens, seed 429; avg@n, pass@k) or paper-search (Search-R1 parquet: greedy, top-3 passages, "
        "4 rounds; EM, F1); an option given overrides the protocol's value",
    )  # fmt: skip
    _add_eval_override_arguments(ev)
    ev.add_argument(
        "--out",
        help="directory for results.json (and responses.jsonl); default: runs/eval with --model, "
        "RUN/eval/step_N[-anchor] with --run",
    )
    ev.set_defaults(func=_eval)


def _add_eval_override_arguments(ev: argparse.ArgumentParser) -> None:
    """eval's sampling, engine and task options: each one given overrides --protocol's value
    (`_eval` reads them by name); --no-progress sits among them in --help."""
    ev.add_argument("--n", type=int, help="samples per problem")
    ev.add_argument("--temperature", type=float, help="sampling temperature")
    ev.add_argument("--top-p", type=float, help="nucleus sampling")
    ev.add_argument(
        "--max-new-tokens", type=int, help="response length limit (capped to the model's context)"
    )
    ev.add_argument("--seed", type=int, help="sampling seed")
    ev.add_argument("--engine", choices=["hf", "vllm"], help="hf (default) or vllm (docs/vllm.md)")
    ev.add_argument("--batch-size", type=int, help="hf: sequences per generate call (default 64)")
    ev.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on a GPU, else float32",
    )
    ev.add_argument("--gpu-memory-utilization", type=float, help="vllm: share of GPU memory (default 0.9)")
    ev.add_argument("--enforce-eager", action="store_true", default=None, help="vllm: no CUDA graphs")
    ev.add_argument("--no-chat-template", action="store_true", help="plain prompts even if the model has one")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument(
        "--prompt", help="math: prompt template with {question} (default: Qwen2.5-Math's \\boxed{} one)"
    )
    ev.add_argument("--retriever-url", help="search: a retrieval server, http://host:port/retrieve")
    ev.add_argument("--corpus", help="search: a jsonl corpus to index with BM25 (instead of --retriever-url)")
    ev.add_argument("--topk", type=int, help="search: passages per search (3)")
    ev.add_argument("--max-turns", type=int, help="search: rounds with the retriever (4)")


def _add_export_parser(sub) -> None:
    """`emapg export`: a checkpoint as a Hugging Face folder."""
    exp = sub.add_parser(
        "export",
        help="a run's checkpoint (policy, or --anchor its anchor) as a Hugging Face folder",
        description="Write the policy (or with --anchor the EMA anchor) saved at a run's checkpoint as a "
        "standard Hugging Face folder (config, safetensors, tokenizer, chat template) that "
        "from_pretrained and vLLM load as it is. Never overwrites: --out must be new or empty.",
    )
    exp.add_argument("run", metavar="RUN_DIR", help="a run directory (runs/<name>)")
    exp.add_argument("--step", type=int, help="the checkpoint's step (default: the last)")
    exp.add_argument("--anchor", action="store_true", help="the anchor's weights, not the policy's")
    exp.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    exp.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
        help="the weights' dtype; auto (the default): the model's own, as model.path holds it (a bf16-mixed "
        "run's checkpoint holds float32 master weights)",
    )  # fmt: skip
    exp.set_defaults(func=_export)


def _add_report_parser(sub) -> None:
    """`emapg report`: learning curves and a table over runs."""
    rep = sub.add_parser(
        "report", help="learning curves of runs on shared axes (seeds grouped) and a table of final figures"
    )
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (runs/<name>)")
    rep.add_argument("--out", default="report.png", help="PNG to write; the table goes beside it as .md")
    rep.add_argument("--threshold", type=float, help="also report the first step eval/accuracy reaches this")
    rep.add_argument("--smooth", type=int, default=5, help="trailing mean over this many steps (not eval)")
    rep.set_defaults(func=_report)


def _add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    """The dense encoder's options, shared by build-index and serve-retriever (read back by
    `_encoder_settings`)."""
    parser.add_argument(
        "--encoder", help="dense: a local Hugging Face encoder folder (e5-base-v2 in the paper)"
    )
    parser.add_argument("--query-prefix", help="dense: prepended to each query (e5: 'query: ')")
    parser.add_argument("--passage-prefix", help="dense: prepended to each passage (e5: 'passage: ')")
    parser.add_argument("--pooling", choices=["mean", "cls"], help="dense: token pooling (e5: mean)")
    parser.add_argument("--max-length", type=int, help="dense: tokens per text (256)")
    parser.add_argument("--batch-size", type=int, help="dense: texts per encoder call (64)")


def _add_build_index_parser(sub) -> None:
    """`emapg build-index`: a BM25 or dense index of a corpus."""
    idx = sub.add_parser(
        "build-index", help="index a jsonl corpus for retrieval: BM25, or dense with --dense (docs/search.md)"
    )
    idx.add_argument("--corpus", required=True, help="jsonl with id and contents (first line: the title)")
    idx.add_argument("--out", help="dense: index folder (default <corpus>.dense; BM25's is <corpus>.bm25)")
    idx.add_argument("--dense", action="store_true", help="encode with --encoder into a FAISS index")
    idx.add_argument(
        "--index-type",
        choices=["flat", "sq8", "hnsw", "ivf"],
        default="flat",
        help="dense: flat (exact, the paper's; 4 x dim bytes a passage), sq8 (1 x dim bytes: for less "
        "RAM), hnsw or ivf (full vectors, faster search); recall in docs/search.md",
    )
    idx.add_argument("--nlist", type=int, help="dense ivf: lists (default 4 x sqrt(passages))")
    idx.add_argument(
        "--shard-docs", type=int, default=50_000, help="dense: passages per saved shard (resume unit)"
    )
    idx.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_encoder_arguments(idx)
    idx.set_defaults(func=_build_index)


def _add_serve_retriever_parser(sub) -> None:
    """`emapg serve-retriever`: a corpus's BM25 or dense index over HTTP."""
    from emapg.tasks.search.server import MAX_PENDING, MAX_QUERIES, MAX_QUERY_CHARS

    srv = sub.add_parser(
        "serve-retriever",
        help="serve BM25 (or a dense index with --dense) over a jsonl corpus at POST /retrieve (Search-R1's format)",
    )
    srv.add_argument("--corpus", required=True, help="jsonl with id and contents (first line: the title)")
    srv.add_argument(
        "--dense",
        nargs="?",
        const="",
        metavar="INDEX",
        help="serve a dense index: a build-index --dense folder (default <corpus>.dense) or a FAISS "
        "file whose row i is passage i (Search-R1's e5_Flat.index)",
    )
    srv.add_argument("--nprobe", type=int, help="dense ivf: lists searched per query")
    srv.add_argument("--ef-search", type=int, help="dense hnsw: search breadth")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    srv.add_argument(
        "--max-queries",
        type=int,
        default=MAX_QUERIES,
        help=f"most queries per request; more get HTTP 413 (default {MAX_QUERIES})",
    )
    srv.add_argument(
        "--max-query-chars",
        type=int,
        default=MAX_QUERY_CHARS,
        help=f"most characters per query; longer get HTTP 413 (default {MAX_QUERY_CHARS})",
    )
    srv.add_argument(
        "--max-pending",
        type=int,
        default=MAX_PENDING,
        help=f"requests admitted at once; one more gets HTTP 503 with Retry-After (default {MAX_PENDING})",
    )
    srv.add_argument(
        "--workers",
        type=int,
        help="BM25: processes that search, so concurrent requests use every core (default: one per "
        "usable core, at most --max-pending; 1: this process's threads only)",
    )
    _add_encoder_arguments(srv)
    srv.set_defaults(func=_serve_retriever)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; every field's help goes into `emapg train --help` (built only when the
    command is train: it imports every part's settings)."""
    parser = argparse.ArgumentParser(prog="emapg", description="EMA Policy Gradient for language models")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(sub, field_help=command == "train")
    _add_rollout_worker_parser(sub)
    _add_sft_parser(sub)
    _add_eval_parser(sub)
    _add_export_parser(sub)
    _add_report_parser(sub)
    _add_build_index_parser(sub)
    _add_serve_retriever_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args, rest = parser.parse_known_args(argv)
    # argparse takes a command's key=value words in one run: those after an option come back here.
    if rest and hasattr(args, "overrides") and all("=" in w and not w.startswith("-") for w in rest):
        args.overrides += rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.func(args)
    except EmapgError as e:
        print(f"emapg: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
