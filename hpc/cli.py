"""The `hpc` command line.

    hpc eval TASK CANDIDATE [--backend cpu|cuda] [--scale cpu|gpu] [--out FILE.h5] [--json]
    hpc eval-suite TASKS CANDIDATES [--backend ...] [--scale ...] [--out FILE.h5] [--only SUBSTR]
    hpc import-kernelbench EVAL_RESULTS --level N --out FILE.h5 [--baseline-eager F] [--baseline-compile F]
        [--tasks DIR]
    hpc synthesize --out RUN [--count N] [--seed S] [--config F] [--from OPS6K] [--import-only] [--benchmark DIR]
        [--backend ...] [--scale ...] [--workers N]
    hpc synthesize --out RUN --validate DATASET [--backend ...] [--scale ...] [--workers N]
    hpc serve --checkpoint RUN|ROOT [--step N] | --hf DIR [--tokenizer byte|DIR]
        [--chat-format auto|chatml|llama3|plain] [--host H] [--port P] [--model-name NAME] [--api-key-env VAR]
        [--dtype auto|fp32|bf16] [--max-request-bytes N]
    hpc repair RESULTS.h5

Every command takes -v/--verbose (debug lines too) or -q/--quiet (warnings and errors only): the
results (tables, JSON) go to stdout, everything else to stderr (hpc/logs.py).

Exit codes: 0 evaluated (eval: and the candidate passed); 1 eval: the candidate failed a stage,
or is no candidate (its record is still printed and written, the reason on stderr); 2 bad input
(one `error:` line), or a record with status error (the task's or the harness's fault: eval-suite
goes on and says so at the end; the records are printed and written all the same).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import stat
import sys
from collections.abc import Iterator

from hpc.entry import Parser
from hpc.errors import CandidateError, ConfigError, UsageError, UserError, check_results_name, read_reason, shown
from hpc.logs import add_logging_args, setup_logging

log = logging.getLogger(__name__)


MAX_SEED = 1 << 62   # seeds derived from it (trials, timing) stay within torch's 64 bits


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def _seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if seed >= MAX_SEED:
        raise argparse.ArgumentTypeError(f"at most {MAX_SEED - 1}, got {seed}")
    return seed


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("cpu", "cuda"), help="where candidates run (default: config, cpu)")
    p.add_argument("--scale", choices=("cpu", "gpu"), help="problem size (default: the backend's own)")
    p.add_argument("--config", type=_path, help="YAML evaluation config (see docs/config.md)")
    p.add_argument("--out", type=_path, help="append records to this HDF5 file (eval-suite skips a task whose "
                                                "record, same candidate, it already holds)")
    p.add_argument("--seed", type=_seed, help="fixed seed for inputs (default: fresh random seeds, recorded)")
    p.add_argument("--iterations", type=int, help="timed iterations (default 100)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hpc", description="Evaluate kernel candidates: compile, verify, profile, reward.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    one = sub.add_parser("eval", help="evaluate one candidate on one task")
    one.add_argument("task", type=_path, help="KernelBench problem file")
    one.add_argument("candidate", type=_path, help="single .py file (ModelNew) or workdir (model_new.py + kernels/)")
    _common(one)
    one.add_argument("--json", action="store_true", help="print one JSON object")
    suite = sub.add_parser("eval-suite", help="evaluate a folder of candidates against a folder of tasks")
    suite.add_argument("tasks", type=_path, help="folder of problem files (e.g. kernels/tasks)")
    suite.add_argument("candidates", type=_path,
                       help="folder of candidates laid out like the tasks (e.g. kernels/solutions)")
    suite.add_argument("--only", action="append", help="evaluate only task ids containing this (repeatable)")
    suite.add_argument("--jobs", type=int, default=1,
                       help="evaluations at once on the device; timed runs still take it alone (default 1)")
    _common(suite)
    imp = sub.add_parser("import-kernelbench", help="convert KernelBench's eval_results.json to records",
                         epilog="example inputs, as KernelBench writes them: docs/formats.md, "
                                "'Importing KernelBench's own results'")
    imp.add_argument("eval_results", help="KernelBench's runs/<run>/eval_results.json")
    imp.add_argument("--level", type=int, required=True, help="the KernelBench level that run evaluated")
    imp.add_argument("--out", required=True, help="append the records to this HDF5 file")
    imp.add_argument("--baseline-eager", help="KernelBench's results/timing/<hardware>/baseline_time_torch.json")
    imp.add_argument("--baseline-compile",
                     help="KernelBench's results/timing/<hardware>/baseline_time_torch_compile_inductor_default.json")
    imp.add_argument("--tasks", help="KernelBench's problem files (its KernelBench/ or levelN folder): the "
                                     "records get their task ids and hashes")
    from hpc.synthesis.config import add_arguments

    syn = sub.add_parser("synthesize", help="compose training tasks, filter them, write a dataset (in this process)")
    add_arguments(syn)
    from hpc.policy import serve

    srv = sub.add_parser("serve", help="serve the policy over OpenAI's chat-completions protocol (docs/agent.md)")
    serve.add_arguments(srv)
    rep = sub.add_parser("repair", help="bring a results file back to the rows its journal holds (after a crash "
                                        "or a full disk)")
    rep.add_argument("results", type=_path, help="the HDF5 results file")
    for command in (one, suite, imp, syn, srv, rep):
        add_logging_args(command)
    return parser


def _config(args):
    from hpc.config import command_line_config

    if args.config is not None:
        _not_special(args.config, f"config {shown(args.config)}", ConfigError)
    try:
        return command_line_config(args.config, args.backend, args.scale, args.iterations, args.seed)
    except UnicodeDecodeError:
        raise ConfigError(f"config {shown(args.config)}: not UTF-8 text") from None


def _not_special(path: str, what: str, error: type[UserError]) -> None:
    """Refuse a path that exists but is no regular file (a folder, a FIFO that a reader would block
    on, a device) or cannot be looked at (a link loop); a missing one is left to its reader."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise error(f"{what}: {read_reason(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what}: {'is a folder' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        setup_logging(args.verbose, args.quiet)
        return _run(args)
    except UserError as e:
        log.error("error: %s", e)
        return 2
    except KeyboardInterrupt:
        log.error("error: interrupted")
        return 130


def _run(args) -> int:
    if args.command == "import-kernelbench":
        return _import_kernelbench(args)
    if args.command == "synthesize":
        return _synthesize(args)
    if args.command == "repair":
        from hpc.results.hdf5 import repair

        print(repair(args.results))
        return 0
    if args.command == "serve":
        from hpc.policy.serve import config_from_args, serve

        return serve(config_from_args(args))
    cfg = _config(args)
    return _eval(args, cfg) if args.command == "eval" else _eval_suite(args, cfg)


def _eval(args, cfg) -> int:
    from hpc.candidate import load_candidate
    from hpc.suite import evaluate_safely, one_line, storable, summary_table, unevaluated
    from hpc.task import load_task

    task = load_task(args.task)
    try:
        candidate, reason = load_candidate(args.candidate), ""
    except CandidateError as e:   # there, but no candidate: its failure, recorded like any other
        candidate, reason = None, str(e)
    with _results(args, cfg) as store:   # one evaluation asked for by name always runs
        rec = storable(evaluate_safely(task, candidate, cfg) if candidate
                       else unevaluated(task, os.path.abspath(args.candidate), cfg, reason))
        if store is not None:
            store.append(None, rec)
    print(json.dumps(rec.summary()) if args.json else summary_table([rec]))
    if rec.status == "error":   # the task's or the harness's fault, not the candidate's
        log.error("%s", one_line(f"error: {task.task_id}: {rec.failed_stage}: {rec.reason}"))
        return 2
    if rec.failed_stage:
        log.warning("%s", one_line(f"{rec.status}: {rec.failed_stage}: {rec.reason}"))
        return 1
    return 0


def _eval_suite(args, cfg) -> int:
    from pathlib import Path

    from hpc.suite import evaluate_suite, one_line, summary_table
    from hpc.task import discover_suite, select_tasks

    if args.jobs < 1:
        raise UsageError(f"--jobs: expected an integer >= 1, got {args.jobs}")
    tasks = select_tasks(discover_suite(args.tasks), args.only, args.tasks)
    if not os.path.isdir(args.candidates):
        raise UsageError(f"candidates {shown(args.candidates)}: "
                         f"{'not a folder' if os.path.lexists(args.candidates) else 'no such folder'}")
    with _results(args, cfg) as store:
        records = evaluate_suite(tasks, Path(args.candidates), cfg, store, args.jobs)
    print(summary_table(records))
    errors = [r for r in records if r.status == "error"]
    if errors:   # everything is recorded; the exit code still says that some task was not evaluated
        log.error("%s", one_line(f"error: {len(errors)} of {len(records)} tasks not evaluated (status error), first "
                                 f"{errors[0].task_id}: {errors[0].failed_stage}: {errors[0].reason}"))
        return 2
    return 0


@contextlib.contextmanager
def _results(args, cfg) -> Iterator[object]:
    """The store of --out (None without it), opened before any evaluation so that a bad --out
    costs nothing; records already in the file are never touched, and their tasks not evaluated
    again."""
    if not args.out:
        yield None
        return
    from hpc.config import config_to_dict
    from hpc.results.hdf5 import RecordStore, provenance

    _not_special(args.out, f"--out {shown(args.out)}", UsageError)
    check_results_name(args.out)
    with RecordStore(args.out, provenance(config_to_dict(cfg))) as store:
        yield store


def _import_kernelbench(args) -> int:
    from pathlib import Path

    from hpc.results.hdf5 import ResultWriter
    from hpc.results.kernelbench import SOURCE, import_config, import_kernelbench
    from hpc.suite import summary_table

    check_results_name(args.out)
    eval_results = Path(args.eval_results)
    tasks, eager, compiled = (Path(p) if p else None for p in (args.tasks, args.baseline_eager, args.baseline_compile))
    records = import_kernelbench(eval_results, args.level, tasks, eager, compiled)
    attrs = {"source": SOURCE, "config": import_config(eval_results, args.level, tasks, eager, compiled)}
    with ResultWriter(args.out, attrs) as writer:
        for rec in records:
            writer.append(rec)
    print(summary_table(records))
    log.info("imported %d records into %s", len(records), args.out)
    return 0


def _synthesize(args) -> int:
    from hpc.errors import writable_folder
    from hpc.synthesis.config import config_from_args
    from hpc.synthesis.shards import print_report, run_local

    cfg = config_from_args(args)
    out = writable_folder(args.out, make=False)   # made once the source checked out
    print_report(run_local(cfg, out), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
