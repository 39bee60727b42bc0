"""Command line: ``python -m mlx_lm_patches {status,check,run,table}``.

* ``status [--json|-v]`` – a summary line (patches by state), versions, activation path, the gate rule (``version range + probe`` for a
  published release, ``probe only`` for a git/local/editable install or a dev/pre-release
  version), warnings (mlx-lm not a release, or newer than the newest tested release) and one row
  per patch, read from the live objects after importing ``mlx_lm`` the way a user would. Exit 1
  if a patch failed.
* ``check [--json] [IDS...]`` – the main job: demonstrate every applicable fix live (see
  ``check.py``), one patch's lines printed as soon as it is judged, then the counts of fixed /
  not needed / not applicable / disabled patches and gaps. Exit 1 if there is a gap.
* ``run -m MODULE [ARGS...]`` / ``run SCRIPT [ARGS...]`` – apply explicitly, then run a module
  or script in this process (for ``python -S``, frozen apps, or no ``.pth``).
* ``table`` – the table of patches (docs/patches.md), generated from compat_matrix.yaml.
"""

import argparse
import contextlib
import json
import runpy
import sys


def _status(args) -> int:
    from mlx_lm_patches.engine import core as engine

    try:
        import mlx_lm  # noqa: F401  - triggers automatic activation, like a user's import
    except ImportError as exc:
        print(f"mlx_lm cannot be imported: {exc}", file=sys.stderr)
    eng = engine.get()
    rows = eng.rows()
    info = {
        "mlx_lm_patches": _version(),
        "mlx_lm": eng.mlx_lm.describe(),
        "mlx": eng.mlx.describe(),
        "packages": {d.name: d.describe() for d in eng.other_packages()},
        "activation": eng.activation or _why_inactive(armed_by()),
        "gate": {"rule": eng.gate_rule(), "text": eng.gate_text()},
        "warnings": eng.warnings(),
        "matrix": str(eng.matrix.path),
        "adaptive_drafting": adaptive_drafting_line(rows),
        "patches": [r.to_dict() for r in rows],
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_status(info, rows, verbose=args.verbose))
    return 1 if any(r.state == "failed" for r in rows) else 0


WIDTH = 100  # columns of the text report


def format_status(info, rows, verbose=False) -> str:
    """``status`` as text, no line wider than :data:`WIDTH`: one summary line, the versions and
    the activation, then a line per patch (id, state, affected range) with why, wrapped;
    ``verbose`` adds what each patch fixes and its Metal note."""
    import textwrap

    states = {}
    for r in rows:
        states[r.state] = states.get(r.state, 0) + 1
    order = ["applied", "failed", "pending", "skipped:version", "skipped:probe", "disabled", "reverted", "inactive"]
    counts = ", ".join(f"{states[s]} {s}" for s in order + sorted(set(states) - set(order)) if s in states)
    others = "".join(f", {name} {version}" for name, version in info["packages"].items())
    lines = [f"mlx-lm-patches {info['mlx_lm_patches']}: {counts}",
             f"versions: mlx-lm {info['mlx_lm']}, mlx {info['mlx']}{others}",
             f"activation: {info['activation']}",
             f"gate: {info['gate']['text']}",
             *(f"warning: {warning}" for warning in info["warnings"]),
             f"matrix: {info['matrix']}",
             *([info["adaptive_drafting"]] if info.get("adaptive_drafting") else [])]
    lines = [wrapped for line in lines for wrapped in textwrap.wrap(line, WIDTH, subsequent_indent="  ")]
    width = max((len(r.id) for r in rows), default=2)
    more = dict(width=WIDTH, initial_indent="      ", subsequent_indent="      ")
    for r in rows:
        about = "" if r.package == "mlx-lm" else f"{r.package} "
        lines += textwrap.wrap(f"  {r.id:<{width}}  {r.state:<15}  affected {about}{r.affected}", WIDTH,
                               subsequent_indent=" " * (width + 21))
        if verbose:
            lines += textwrap.wrap(r.summary, **more)
        if r.detail:
            lines += textwrap.wrap(f"-> {r.detail}", **more)
        if verbose and r.metal:
            lines += textwrap.wrap(f"Metal: {r.metal}", **more)
    return "\n".join(lines)


def adaptive_drafting_line(rows=None) -> str:
    """Whether speculative decoding adapts its draft length (patch ``adaptive-drafting`` and
    ``MLX_LM_PATCHES_ADAPTIVE_DRAFTING``), as one line."""
    from mlx_lm_patches.engine import core as engine
    from mlx_lm_patches.engine import env

    rows = rows if rows is not None else engine.get().rows()
    state = next((r.state for r in rows if r.id == "adaptive-drafting"), "unknown")
    if state != "applied":
        return f"adaptive drafting: off (patch adaptive-drafting {state}; num_draft_tokens fixed)"
    if not env.setting(env.ADAPTIVE_DRAFTING):
        return f"adaptive drafting: off ({env.ADAPTIVE_DRAFTING}=0; num_draft_tokens fixed)"
    return f"adaptive drafting: on (draft tokens per round 0..num_draft_tokens; {env.ADAPTIVE_DRAFTING}=0 turns it off)"


def armed_by():
    """How the bootstrap armed automatic activation in this process (``None``: not armed)."""
    boot = sys.modules.get("_mlx_lm_patches_boot")
    return boot.armed_by() if boot is not None else None


def _why_inactive(armed_by) -> str:
    from mlx_lm_patches.engine import env

    try:
        enabled = env.flag(env.ENABLED, default=True)
    except env.EnvError as exc:
        return f"none ({exc})"
    if not enabled:
        return f"none ({env.ENABLED}=0)"
    if armed_by:
        return f"armed by {armed_by}, not yet triggered"
    return "none (not armed: package not installed with its .pth; use apply() or mlx-lm-patches-run)"


def _version() -> str:
    from mlx_lm_patches import __version__

    return __version__


def _check(args) -> int:
    import os

    # Everything check runs is built locally; stock mlx-lm must not reach for the hub either
    # (e.g. load("mtp") on a release without the MTP selection).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mlx_lm_patches.engine import check

    # the report streams: one patch's lines as soon as it is judged (text on stdout; with
    # --json, its verdict line on stderr and the JSON on stdout at the end)
    report = sys.stderr if args.json else sys.stdout

    def show(lines):
        print("\n".join(lines), file=report, flush=True)

    if not args.json:
        show([check.header(), ""])
    # what the scenarios' mlx-lm calls print (e.g. convert's "[INFO] Quantizing") goes to
    # stderr: stdout carries the report alone
    with contextlib.redirect_stdout(sys.stderr):
        results = check.run_check(args.ids or None,
                                  on_result=lambda r: show(check.format_result(r)[:1 if args.json else None]))
    if args.json:
        show([check.summary(results)])
        print(json.dumps(check.report_dict(results), indent=2))
    else:
        show([check.format_footer(results)])
    before, again = check.restored
    return 0 if all(r.holds for r in results) and len(again) == len(before) else 1


def _table(args) -> int:
    from mlx_lm_patches.engine import matrix

    print(render_table(matrix.load()))
    return 0


def render_table(the_matrix) -> str:
    lines = [
        "| id | fixes | affected mlx-lm | fixed in |",
        "|---|---|---|---|",
    ]
    for spec in the_matrix.patches:
        about = "" if spec.package == "mlx-lm" else f"{spec.package} "
        fixed = f"{about}{spec.fixed_in}" if spec.fixed_in else "not yet"
        needs = "".join(f" with {name} `{specifier}`" for name, specifier in spec.requires)
        lines.append(f"| `{spec.id}` | {spec.summary} | {about}`{spec.affected}`{needs} | {fixed} |")
    return "\n".join(lines)


def _run(args) -> int:
    from mlx_lm_patches.engine import core as engine

    if not args.target:
        print("run: give -m MODULE or a script path", file=sys.stderr)
        return 2
    try:
        engine.apply()
    except (engine.PatchError, ValueError) as exc:
        print(f"mlx-lm-patches: {exc}", file=sys.stderr)
        return 1
    if args.module:
        from mlx_lm_patches.engine.launcher import console_main

        sys.argv = [args.target] + args.args
        command = console_main(args.target)
        if command is not None:  # the patched module itself, not a second copy of it
            sys.argv[0] = sys.modules[args.target].__file__
            return command()
        runpy.run_module(args.target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [args.target] + args.args
        runpy.run_path(args.target, run_name="__main__")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_lm_patches", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", help="installed versions, activation and per-patch state")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="also what each patch fixes, and Metal notes")
    p.set_defaults(func=_status)
    p = sub.add_parser("check", help="demonstrate every applicable fix on tiny models")
    p.add_argument("ids", nargs="*", help="patch ids (default: all)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(func=_check)
    p = sub.add_parser("table", help="print the table of patches (docs/patches.md)")
    p.set_defaults(func=_table)
    p = sub.add_parser("run", help="apply, then run a module (-m) or a script in this process")
    p.add_argument("-m", dest="module", action="store_true", help="run TARGET as a module")
    p.add_argument("target", nargs="?")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # malformed environment variables, unknown ids
        print(f"mlx-lm-patches: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
