"""``warsha``: run recipes, inspect artifacts, describe stages.

Heavy libraries (torch, transformers) are imported only inside the commands that need them,
so ``warsha --help`` and recipe validation answer in well under a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

EXAMPLES = """examples:
  warsha run recipes/arabic-tiny.yaml                       run every stage (skips finished ones)
  warsha run recipes/arabic-tiny.yaml --dry-run             validate and print the plan
  warsha run recipes/arabic-tiny.yaml bootstrap.train.steps=50 --only bootstrap
  warsha run recipes/arabic-tiny.yaml stages[1].params.vocab_size=8000 --from extend --force
  warsha inspect runs/arabic-tiny/bootstrap                 manifest and metrics of an artifact
  warsha stages                                             every stage and its parameters
  warsha serve runs/arabic-tiny/gptq --draft runs/arabic-tiny/draft --port 8000
                                                            OpenAI-compatible HTTP server
on a GPU cluster:
  accelerate launch --config_file recipes/accelerate/<cfg>.yaml -m warsha run RECIPE
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (kept separate so tests can check the help text)."""
    parser = argparse.ArgumentParser(
        prog="warsha",
        description="Adapt an LLM to a new language (Arabic first) and ship it ready to serve.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a recipe's stages",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a recipe. Finished stages whose config and inputs are unchanged are skipped;"
        " a killed training stage resumes from its last checkpoint.",
    )
    run.add_argument("recipe", type=Path, help="recipe YAML file")
    run.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. stages.yarn.params.factor=8")
    run.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<recipe name>)")
    run.add_argument("--from", dest="from_stage", default=None, help="run from this stage id on")
    run.add_argument("--only", default=None, help="run only this stage id")
    run.add_argument("--force", action="store_true", help="rerun selected stages even if up to date")
    run.add_argument("--dry-run", action="store_true", help="validate and print the plan; load no weights")
    insp = sub.add_parser("inspect", help="show an artifact's manifest and metrics")
    insp.add_argument("artifact", type=Path)
    insp.add_argument("--json", action="store_true", help="print the raw manifest")
    insp.add_argument("--verify", action="store_true", help="also check every file's sha256")
    sub.add_parser("stages", help="list registered stages and their parameters")
    rep = sub.add_parser("report", help="write report.md with plots from a run directory's manifests")
    rep.add_argument("run_dir", type=Path)
    imp = sub.add_parser("import", help="import a GGUF file or package, or an HF directory, as an HF model directory")
    imp.add_argument("source", help="a .gguf file, an HF model directory, or an installed package name")
    imp.add_argument("out", type=Path, help="output model directory")
    imp.add_argument("--sha256", default=None, help="expected sha256 of the GGUF")
    imp.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    sub.add_parser(
        "serve",
        add_help=False,
        help="serve a model directory over an OpenAI-compatible HTTP API "
        "(same flags as `python -m serve`; see `warsha serve --help`)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for a bad recipe or input)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the serve package owns its flags; it must not depend on warsha
        quiet_environment()
        from serve.api.cli import main as serve_main

        return serve_main(argv[1:], prog="warsha serve")
    args = parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not args.verbose:  # accelerate logs four INFO lines per checkpoint; warsha.training logs one
        logging.getLogger("accelerate").setLevel(logging.WARNING)
    quiet_environment()
    from warsha.artifacts import ArtifactError
    from warsha.config import RecipeError

    try:
        return COMMANDS[args.command](args)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ArtifactError, PermissionError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; ``run``'s ``key=value`` overrides may come after its options too
    (argparse alone stops collecting positionals at the first option)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "run":
        late = [e for e in extra if "=" in e and not e.startswith("-")]
        args.overrides = [*args.overrides, *late]
        extra = [e for e in extra if e not in late]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def quiet_environment() -> None:
    """Offline by default (no code in Warsha may fetch weights or data from a hub), and no
    library progress bars when stderr is a file: their carriage-return redraws are unreadable
    there, and Warsha's own progress (``warsha.progress``) already reports the long work."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("WANDB_MODE", "offline"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("WANDB_SILENT", "true"),
    ):
        os.environ.setdefault(key, value)
    if not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/kfd")):
        # DeepSpeed (imported by accelerate) warns on every command that it fell back to the CPU
        # when it has to detect the device itself; with no GPU driver present, say it up front.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # see docs/stack.md
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_drop_too_long_notice)


def _drop_too_long_notice(record: logging.LogRecord) -> bool:
    """False for transformers' "sequence length is longer than the maximum" notice.

    Warsha tokenizes whole documents on purpose (perplexity, calibration and distillation data
    are cut into windows afterwards); the notice fires once per tokenizer whose
    ``model_max_length`` is the model's context, i.e. in every stage after YaRN.
    """
    return not record.getMessage().startswith("Token indices sequence length is longer")


def cmd_run(args: argparse.Namespace) -> int:
    """Validate, plan, then run (or print the plan)."""
    from warsha import distributed, pipeline, runtime
    from warsha.config import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if not args.dry_run:  # allocator and threads before the first tensor (warsha.runtime)
        runtime.apply(recipe.allocator, recipe.threads, reexec=True)
    root = pipeline.out_root(recipe, args.out)
    steps = pipeline.plan(recipe, root)
    select = pipeline.select_stages(steps, args.from_stage, args.only)
    if args.dry_run:
        print_plan(steps, select)
        return 0
    pipeline.check_writable(root)
    pipeline.Runner(recipe, root, force=args.force).run(steps, select)
    distributed.shutdown()  # on success only: a barrier after one rank failed would hang the rest
    print_summary(steps)
    if distributed.world_size() > 1:
        distributed.leave(0)
    return 0


def print_plan(steps: list, select: set[int]) -> None:
    """One line per stage: what would run, from which inputs, into which directory."""
    from warsha.artifacts import read_manifest

    for s in steps:
        manifest = read_manifest(s.out_dir)
        state = (
            "not selected"
            if s.index not in select
            else ("up to date" if manifest and manifest.get("config_hash") == s.config_hash else "will run")
        )
        ins = ", ".join(f"{r}={p}" for r, p in s.inputs.items()) or "-"
        print(f"{s.index + 1:>2}. {s.stage:<24} id={s.key:<12} {state:<13} in: {ins}  out: {s.out_dir}")


def print_summary(steps: list) -> None:
    """Headline metrics of each stage after a run."""
    from warsha.tracking import flatten

    for s in steps:
        print(f"== {s.stage} ({s.key}): {s.status} -> {s.out_dir}")
        for key, value in flatten(s.metrics).items():
            if isinstance(value, float):
                print(f"   {key}: {value:.4g}")
            elif isinstance(value, (int, str, bool)) and len(str(value)) < 200:
                print(f"   {key}: {value}")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print an artifact's manifest summary and metrics."""
    from warsha.artifacts import ArtifactError, read_manifest, verify
    from warsha.tracking import flatten

    manifest = read_manifest(args.artifact)
    if manifest is None:
        raise ArtifactError(f"{args.artifact}: no warsha.json; not a finished Warsha artifact")
    if args.verify:
        verify(args.artifact)
        print("files: all sha256 match the manifest")
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    print(f"stage: {manifest['stage']} (id {manifest['id']}, recipe {manifest.get('recipe')})")
    print(f"created: {manifest.get('created')}  wall time: {manifest.get('wall_time_s')} s")
    for item in manifest.get("inputs", []):
        print(f"input {item['role']}: {item['path']} sha256 {item['sha256'][:16]}")
    print(f"tracking: {manifest.get('tracking')}")
    for key, value in flatten(manifest.get("metrics", {})).items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return 0


def cmd_stages(args: argparse.Namespace) -> int:
    """List every registered stage with its parameters and defaults."""
    from warsha.registry import get_stage, known_stages
    from warsha.schema import describe

    for name in known_stages():
        sdef = get_stage(name)
        print(f"{name}: {sdef.description}")
        for field_name, tp, default, help_text in describe(sdef.params):
            print(f"    {field_name} ({tp}) = {default!r}  {help_text}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Write report.md from a run directory's manifests."""
    from warsha.report import write_report

    path = write_report(args.run_dir)
    print(f"report: {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """The ``import`` stage outside a recipe: same checks, same files, same manifest."""
    from warsha.model_import.stage import import_cli

    import_cli(args.source, args.out, args.sha256, args.dtype)
    print(f"imported: {args.out}")
    return 0


COMMANDS = {"import": cmd_import, "run": cmd_run, "inspect": cmd_inspect, "stages": cmd_stages, "report": cmd_report}
