"""``trtkv export ENGINE --out DIR``: the click command (registered by trtkv/cli.py; heavy imports when it runs)."""
from __future__ import annotations

from pathlib import Path

import click

from trtkv.export import DEFAULT_OPSET


@click.command("export")
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Directory for the ONNX files.")
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True, help="Default-domain opset (18..23).")
@click.option("--inline", is_flag=True, help="Inline the trtkv functions (for tools that cannot read functions).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Policy parameter override (repeatable).")
@click.option("--check", is_flag=True,
              help="Then run the graphs with Polygraphy (ONNX Runtime) on recorded steps against the PyTorch "
                   "engine's logits and print the max abs/rel error per output.")
@click.option("--atol", type=float, default=1e-2, show_default=True, help="--check: absolute logits tolerance.")
@click.option("--rtol", type=float, default=1e-2, show_default=True, help="--check: relative logits tolerance.")
def export_cmd(engine, out, opset, inline, sets, check, atol, rtol) -> None:
    """Write ENGINE's prefill and decode steps as ONNX (trtkv plugins as trtkv-domain functions) to --out."""
    from trtkv.cli import parse_sets
    from trtkv.export import require_onnx

    require_onnx()
    from trtkv.api import Engine
    from trtkv.export.exporter import check_exportable, export_engine

    eng = Engine.load(engine, device="cpu", policy_overrides=parse_sets(sets) or None)
    check_exportable(eng)
    m = export_engine(eng, out, opset=opset, inline=inline, log=lambda msg: click.echo(msg, err=True))
    click.echo(f"exported {m.policy} engine ({', '.join(m.kv.formats)}) to {out} "
               f"({', '.join(g.file for g in m.graphs.values())}, export.json)")
    if check:
        from trtkv.errors import TrtkvError
        from trtkv.export.check import CHECK_PROMPTS, run_check

        click.echo(f"polygraphy: ONNX Runtime vs the PyTorch engine's logits, {len(CHECK_PROMPTS)} prompts "
                   "(greedy, teacher-forced replay)")
        results = run_check(engine, out, atol=atol, rtol=rtol, log=click.echo)
        failed = [r.graph for r in results if not r.passed]
        if failed:
            raise TrtkvError(f"polygraphy check failed for {', '.join(failed)} (atol {atol:g}, rtol {rtol:g})")
