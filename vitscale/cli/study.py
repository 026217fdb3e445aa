"""`vitscale study plan | report | recommend`: the scaling study's verbs besides `vitscale run`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from vitscale.cli.interrupt import writes
from vitscale.cli.parser import add_endpoint_url, writing


def cmd_plan(args: argparse.Namespace) -> int:
    """Every cell with its parameters and planned compute; refused when over `study.max_exaflops`."""
    from vitscale.config.loader import absolute_paths
    from vitscale.scaling.study.plan import plan_markdown
    from vitscale.scaling.study.stage import plan, pricing
    from vitscale.stages import load_pipeline
    from vitscale.stages.run import resolve_pipeline_path

    config = load_pipeline(resolve_pipeline_path(args.pipeline), args.set)
    if "study" not in config.stages:
        from vitscale.config.checks import ConfigError

        raise ConfigError("stages", f"no study stage to plan: {list(config.stages)}", source=args.pipeline)
    config = absolute_paths(config)
    # Planning writes no dataset and runs no data checks (`vitscale run` does both before any compute).
    facts, planned = plan(config, planning=True, check_data=False)
    if args.json:
        print(json.dumps([p.row() for p in planned], indent=1))
    else:
        print(plan_markdown(planned, facts, pricing(config)), end="")
    return 0


@writes
def cmd_report(args: argparse.Namespace) -> int:
    """Tables, plots and fits from a study directory's stored state (while it runs, too)."""
    from vitscale.data.storage.outputs import check_output
    from vitscale.scaling.study.report import backtest_lines, fit_line, publish_report
    from vitscale.scaling.study.state import StudyState

    # The report is written into the study directory: one that cannot take files (a read-only mount, a file)
    # is refused naming it before the fits, and a disk that fills while writing is one line, not a traceback.
    check_output(args.study_dir, "study_dir", folder=True, endpoint_url=args.endpoint_url)
    with writing(f"study report into {args.study_dir}"):
        report = publish_report(StudyState(args.study_dir, args.endpoint_url), args.metric)
    if args.json:
        print(json.dumps({"metric": report.metric, "rows": report.rows, "files": report.files,
                          "fits": {f: fit.row() for f, fit in report.fits.items()}, "no_fit": report.refused,
                          "backtest": {f: b if isinstance(b, str) else [r.row() for r in b]
                                       for f, b in report.backtests.items()},
                          "frontier": report.frontier},
                         default=str))
        return 0
    done = sum(not r["partial"] for r in report.rows)
    print(f"{done}/{len(report.rows)} cells finished" + (" (partial rows marked)" if done < len(report.rows) else ""))
    for family, fit in report.fits.items():
        print(f"fit {family}: {fit_line(fit)}")
        for warning in fit.warnings:
            print(f"   warning: {warning}")
    for family, why in report.refused.items():
        print(f"fit {family}: none ({why})")
    print("\n".join(backtest_lines(report)))
    print("\n".join(report.files))
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    """Which family and size for a budget of X exaFLOPs, from the fits of a study's results."""
    import tempfile
    from pathlib import Path

    from vitscale.scaling.study.report import build_report, recommendation_text
    from vitscale.scaling.study.state import StudyState

    with tempfile.TemporaryDirectory() as tmp:  # recommend reads; it leaves the study directory alone
        report = build_report(StudyState(args.study_dir, args.endpoint_url), Path(tmp), args.metric)
    print(recommendation_text(report, args.budget))
    return 0


def add_verbs(verbs: Any, verb: Callable[..., argparse.ArgumentParser]) -> None:
    """`vitscale study ...` under the CLI's verbs."""
    study = verbs.add_parser("study", help="Plan a scaling study, report its results, recommend a model for a budget.")
    study_verbs = study.add_subparsers(dest="study_verb", required=True, metavar="VERB")

    p = verb("plan", cmd_plan, "Every cell of a study pipeline with its planned compute (nothing runs).", study_verbs)
    p.add_argument("pipeline", help="a pipeline with a study stage (e.g. scaling-study-local)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set study.max_exaflops=10 (repeatable)")
    p.add_argument("--json", action="store_true", help="a list of cells: model, epochs, examples, exaflops, ...")

    for name, func, text in (("report", cmd_report, "Regenerate a study's tables, plots and fits from its state."),
                             ("recommend", cmd_recommend, "The family and size to pick for a compute budget.")):
        p = verb(name, func, text, study_verbs)
        p.add_argument("study_dir", help="the study directory (STORAGE_PATH/RUN_NAME/study, or study.directory; "
                                         "s3:// too)")
        p.add_argument("--metric", default=None, help="accuracy column to fit (default: the study's fit_metric)")
        add_endpoint_url(p)
        if name == "recommend":
            p.add_argument("--budget", type=float, required=True, help="pre-training compute in exaFLOPs")
        else:
            p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
